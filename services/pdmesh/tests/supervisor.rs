//! Issue 40, defect 8: `pdmesh up` restarts its children from the binary it runs, held open
//! from its start, so rebuilding the binary (a new file at its path, the old one deleted)
//! cannot break a restart; and a child that cannot be started again stops `pdmesh up` with
//! the reason on its terminal and a non-zero exit, instead of leaving a node down in silence.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{pdmesh_bin, reserve_ports};

/// `pdmesh up` started from a private copy of the binary (so the test may replace it) on a
/// one-node synthetic mesh.
struct Up {
    up: Child,
    run_dir: PathBuf,
    bin: PathBuf,
    http: u16,
}

impl Up {
    fn start(prefix: &str) -> Up {
        let (http, base) = reserve_ports();
        let (run_dir, topology) = common::one_node_run_dir(prefix, http, base, |_| {});
        let bin_dir = run_dir.with_extension("bin");
        let _ = std::fs::remove_dir_all(&bin_dir);
        std::fs::create_dir_all(&bin_dir).unwrap();
        let bin = bin_dir.join("pdmesh");
        std::fs::copy(pdmesh_bin(), &bin).unwrap();
        // A binary just written can be "busy" for a moment: another test thread's fork may hold
        // the copy's write descriptor until its exec (ETXTBSY); try again briefly.
        let mut tries = 0;
        let up = loop {
            let spawned = Command::new(&bin)
                .arg("up")
                .arg("--topology")
                .arg(&topology)
                .env("PDMESH_RUN_DIR", &run_dir)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(run_dir.join("up.err")).unwrap())
                .spawn();
            match spawned {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => break other.unwrap(),
            }
        };
        let mut me = Up { up, run_dir, bin, http };
        me.wait_healthy("the mesh starts");
        me
    }

    fn wait_healthy(&mut self, what: &str) {
        let url = format!("http://127.0.0.1:{}/health", self.http);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if reqwest::blocking::get(&url).is_ok_and(|r| r.status().is_success()) {
                return;
            }
            assert!(self.up.try_wait().unwrap().is_none(), "{what}: pdmesh up exited:\n{}", self.stderr());
            assert!(Instant::now() < deadline, "{what}: not healthy in 60 s:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.run_dir.join("up.err")).unwrap_or_default()
    }

    fn processes(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(self.run_dir.join("mesh.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["processes"].as_array().unwrap().clone()
    }

    fn pid_of(&self, service: &str) -> i32 {
        self.processes().iter().find(|p| p["service"] == service).and_then(|p| p["pid"].as_i64()).unwrap() as i32
    }

    /// "Rebuild" the binary as cargo does: the file at its path is replaced by a new one (a
    /// new inode); the one `pdmesh up` runs is deleted.
    fn rebuild(&self) {
        std::fs::remove_file(&self.bin).unwrap();
        std::fs::copy(pdmesh_bin(), &self.bin).unwrap();
    }

    fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if let Some(status) = self.up.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ =
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.up.id() as i32), nix::sys::signal::Signal::SIGTERM);
        if self.wait_exit(30).is_none() {
            let _ = self.up.kill();
            let _ = self.up.wait();
        }
        let _ = std::fs::remove_dir_all(self.run_dir.with_extension("bin"));
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

fn kill9(pid: i32) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
}

#[test]
fn a_child_is_restarted_after_the_binary_was_rebuilt() {
    let mut up = Up::start("pdmesh-rebuild");
    up.rebuild();
    let old = up.pid_of("dp-lb");
    kill9(old);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let restarted = up.processes().into_iter().find(|p| p["service"] == "dp-lb").is_some_and(|p| {
            p["alive"] == true && p["restarts"].as_u64() >= Some(1) && p["pid"].as_i64() != Some(i64::from(old))
        });
        if restarted {
            break;
        }
        assert!(Instant::now() < deadline, "dp-lb was not restarted after the rebuild:\n{}", up.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    up.wait_healthy("the restarted node serves");
    let r = reqwest::blocking::Client::new()
        .post(format!("http://127.0.0.1:{}/v1/completions", up.http))
        .json(&serde_json::json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", up.stderr());
    let log = std::fs::read_to_string(up.run_dir.join("logs/main.dp-lb.log")).unwrap();
    assert!(!log.contains("No such file"), "{log}");
}

#[test]
fn a_child_that_cannot_be_restarted_stops_up_with_the_reason() {
    let mut up = Up::start("pdmesh-norestart");
    // The host takes away what a restart needs: the child's log cannot be opened any more.
    let logs = up.run_dir.join("logs");
    let kept = up.run_dir.join("logs.kept");
    std::fs::rename(&logs, &kept).unwrap();
    std::fs::write(&logs, "not a directory").unwrap();
    kill9(up.pid_of("dp-lb"));
    let status = up.wait_exit(60).unwrap_or_else(|| panic!("pdmesh up kept running:\n{}", up.stderr()));
    let stderr = up.stderr();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("cannot restart main.dp-lb"), "the reason is on the terminal:\n{stderr}");
    assert!(stderr.contains("logs/main.dp-lb.log"), "it names what failed:\n{stderr}");
    let _ = std::fs::remove_file(&logs);
    let _ = std::fs::rename(&kept, &logs);
}
