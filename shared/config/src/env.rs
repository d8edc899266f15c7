//! Every `PDMESH_*` environment variable, as documented constants (`docs/CONFIG.md`).

/// Path of the topology file (`pdmesh up` and every service).
pub const TOPOLOGY: &str = "PDMESH_TOPOLOGY";
/// Directory for `ipc://` sockets (overrides the topology's `run_dir`).
pub const RUN_DIR: &str = "PDMESH_RUN_DIR";
/// GGUF model file (overrides an empty `model.path`).
pub const MODEL_PATH: &str = "PDMESH_MODEL_PATH";
/// Directory where `scripts/fetch-model.sh` puts models.
pub const MODEL_DIR: &str = "PDMESH_MODEL_DIR";
/// Fault injection for the transfer agent of this process (overrides the node's
/// `kv_transfer.fault_injection`; docs/KV_TRANSFER.md lists the faults).
pub const FAULT: &str = "PDMESH_FAULT";
/// Fault injection for the executor of this process's workers (overrides the node's
/// `model.fault_injection`: `step_error_every=N` or `device_lost_at_step=N`).
pub const EXECUTOR_FAULT: &str = "PDMESH_EXECUTOR_FAULT";
/// Fault injection for the engine-core of this process (overrides the node's
/// `engine.fault_injection`: `refuse_admission_every=N`).
pub const ENGINE_FAULT: &str = "PDMESH_ENGINE_FAULT";
/// `recompute` or `fail` (overrides the node's `kv_transfer.kv_load_failure_policy`).
pub const KV_LOAD_FAILURE_POLICY: &str = "PDMESH_KV_LOAD_FAILURE_POLICY";
/// Where GGUF models run: `cpu` or `cuda` / `cuda:N` (overrides every node's `model.device`;
/// `cuda` needs a binary built with the `cuda` feature).
pub const MODEL_DEVICE: &str = "PDMESH_MODEL_DEVICE";
/// `shm`, `tcp` or `cuda`: the transfer backend of every P/D node (overrides
/// `kv_transfer.backend`; `cuda` also needs `model.device = "cuda"`, e.g. through
/// `PDMESH_MODEL_DEVICE`). Runs the P/D test suites on another backend unchanged.
pub const KV_BACKEND: &str = "PDMESH_KV_BACKEND";
/// `true` or `false`: the R2/R4 give-up notices of D and the router (overrides
/// `kv_transfer.give_up_notices` and `router.give_up_notices` on every node).
pub const GIVE_UP_NOTICES: &str = "PDMESH_GIVE_UP_NOTICES";
/// `true` or `false`: automatic prefix caching of every node's engine (overrides
/// `engine.enable_prefix_caching`).
pub const ENABLE_PREFIX_CACHING: &str = "PDMESH_ENABLE_PREFIX_CACHING";
/// `true` or `false`: the worker-side overlap of the next decode step with the mesh's hops
/// (overrides `engine.async_scheduling`).
pub const ASYNC_SCHEDULING: &str = "PDMESH_ASYNC_SCHEDULING";
/// Client API keys of every frontend, the router included, comma-separated (vLLM's
/// `--api-key`; `pdmesh frontend --api-key` and `pdmesh up --api-key` take the same list).
/// Unset: no key is required.
pub const API_KEY: &str = "PDMESH_API_KEY";
/// A file of client API keys, one per line (blank lines and `#` comments ignored); adds to
/// [`API_KEY`]. Keeps keys out of the environment listing and the command line.
pub const API_KEY_FILE: &str = "PDMESH_API_KEY_FILE";
/// The mesh's internal credential: the router presents it to the P and D nodes, which accept
/// it in addition to the client keys. `pdmesh up` generates a fresh one per run when client
/// keys are set and this is not. Only read from the environment, never a flag (`ps` shows
/// command lines).
pub const INTERNAL_API_KEY: &str = "PDMESH_INTERNAL_API_KEY";
/// The mesh secret (at least 32 characters; `openssl rand -hex 32`): every P/D side channel,
/// `tcp` block server and `tcp` internal link authenticates with it (docs/SECURITY.md).
/// Overrides the topology's `mesh_secret_file`. `pdmesh up` generates one per run when neither
/// is given and passes it to its children in this variable (never on a command line).
pub const MESH_SECRET: &str = "PDMESH_MESH_SECRET";
/// Seconds a service has to stop gracefully once SIGINT/SIGTERM arrives (readiness 503,
/// in-flight work drained, P's blocks given back); a stop past it exits with status 124.
/// Default 10. `pdmesh up` waits this long plus a grace period before it kills a child.
pub const SHUTDOWN_DEADLINE_S: &str = "PDMESH_SHUTDOWN_DEADLINE_S";
/// `json` for JSON log lines.
pub const LOG_FORMAT: &str = "PDMESH_LOG_FORMAT";

/// Read a variable, treating empty as unset.
pub fn get(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}
