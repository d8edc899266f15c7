//! Every message round-trips through the codec; random or foreign bytes give typed errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_protocol::*;
use proptest::prelude::*;

fn params() -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: Some(true),
        do_remote_decode: Some(false),
        remote_engine_id: Some("p-0".into()),
        remote_request_id: Some("cmpl-1".into()),
        remote_block_ids: Some(vec![1, 2, 3]),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(5600),
        tp_size: Some(1),
        remote_block_generations: Some(vec![7, 7, 8]),
        remote_dp_rank: Some(1),
        remote_capability: Some("0123456789abcdef0123456789abcdef".into()),
    }
}

/// One (or more) of every message: the round-trip test below and the fuzz seeds (`fuzz/`, which
/// includes this file) both use it, so a new message is fuzzed from a real frame once it is here.
pub fn every_message() -> Vec<Message> {
    let sampling = SamplingParams {
        seed: Some(3),
        logprobs: Some(2),
        stop_token_ids: vec![5],
        repetition_penalty: 1.2,
        frequency_penalty: -0.5,
        min_tokens: 4,
        bad_words_token_ids: vec![vec![7, 8]],
        ..Default::default()
    };
    let logprobs = TokenLogprobs { logprob: -0.5, top: vec![(1, -0.5), (2, -1.5)] };
    let kv_out = KvConnectorOutput {
        finished_sending: vec!["a".into()],
        finished_recving: vec!["b".into()],
        invalid_block_ids: vec![4],
        leased_request_ids: vec!["a".into()],
    };
    let meta = KvConnectorMetadata {
        reqs_to_recv: vec![RecvRequest {
            request_id: "r".into(),
            local_block_ids: vec![9],
            params: params(),
            rejected_at_unix_us: Some(7),
            trace: pdmesh_protocol::TraceContext {
                traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
                tracestate: None,
            },
        }],
        reqs_to_send: vec![SendRequest {
            request_id: "s".into(),
            block_ids: vec![1, 2],
            block_generations: vec![3, 3],
            deadline_unix_ms: 123,
            capability: "0123456789abcdef0123456789abcdef".into(),
        }],
        reqs_in_batch: vec!["x".into()],
        reqs_not_processed: vec!["y".into()],
        reqs_aborted_after_finish: vec!["z".into()],
        reqs_to_heartbeat: vec![params()],
        reqs_referenced: vec![params()],
        offload: pdmesh_protocol::OffloadMetadata {
            loads: vec![pdmesh_protocol::OffloadTransfer {
                request_id: "l".into(),
                block_ids: vec![5, 6],
                slots: vec![0, 7],
                stamps: vec![u64::MAX, 1],
            }],
            saves: vec![pdmesh_protocol::OffloadTransfer {
                request_id: "s".into(),
                block_ids: vec![1],
                slots: vec![2],
                stamps: vec![3],
            }],
        },
        extra_async_saves: [("s".to_string(), 1)].into(),
    };
    vec![
        Message::AddRequest(EngineRequest {
            request_id: "cmpl-1".into(),
            client_request_id: None,
            prompt_token_ids: vec![1, 2, 3],
            sampling: sampling.clone(),
            eos_token_ids: vec![2],
            arrival_unix_ms: 99,
            kv_transfer_params: Some(params()),
            data_parallel_rank: Some(1),
        }),
        Message::Abort(AbortRequests { request_ids: vec!["a".into(), "b".into()] }),
        Message::Hello(Hello { service: ServiceKind::EngineCore, rank: 2, pid: 77 }),
        Message::StatsQuery,
        Message::ReadinessQuery,
        Message::Readiness(NodeReadiness { ranks: 2, ranks_up: 1 }),
        Message::StatsReply(MeshStats {
            engines: vec![EngineStats {
                engine_rank: 1,
                num_waiting: 2,
                num_running: 3,
                kv: KvUsage {
                    total_blocks: 10,
                    free_blocks: 5,
                    used_blocks: 3,
                    held_blocks: 2,
                    leased_blocks: 0,
                    cached_blocks: 4,
                },
                held_requests: vec![HeldRequest {
                    request_id: "h".into(),
                    blocks: 2,
                    age_s: 0.5,
                    state: "held".into(),
                }],
                steps: 4,
                finished_requests: 5,
                request_finished_calls: 5,
                unknown_ids: 1,
                preemptions: 0,
                prefix: Some(PrefixSummary { block_size: 16, root: vec![7; 32], blocks: vec![1, u64::MAX] }),
            }],
            unreachable_ranks: vec![3],
        }),
        Message::EngineOutputs(EngineOutputBatch {
            engine_rank: 0,
            outputs: vec![EngineOutput {
                request_id: "cmpl-1".into(),
                new_token_ids: vec![5],
                new_logprobs: Some(vec![logprobs.clone()]),
                finish_reason: Some(FinishReason::Length),
                stop_token_id: None,
                kv_transfer_params: Some(params()),
                num_external_tokens: 16,
                num_cached_tokens: 16,
                error: None,
            }],
        }),
        Message::LoadReport(EngineLoadReport {
            engine_rank: 1,
            num_waiting: 1,
            num_running: 2,
            kv: KvUsage::default(),
            finished_request_ids: vec!["a".into(), "b".into()],
        }),
        Message::WorkerInfoQuery,
        Message::WorkerInfo(WorkerInfo {
            model_name: "m".into(),
            num_blocks: 64,
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 3,
            head_dim: 64,
            max_model_len: 2048,
            vocab_size: 300,
            eos_token_ids: vec![2],
            bytes_per_block: 4096,
            incarnation: "1-abc".into(),
        }),
        Message::ExecuteStep(SchedulerOutput {
            step_id: 9,
            chunks: vec![ScheduledChunk {
                request_id: "r".into(),
                token_ids: vec![1, 2],
                start_pos: 0,
                block_ids: vec![0],
                sample: true,
                sampling,
                output_index: 0,
                guided_output: Vec::new(),
                history: Some(SamplingHistory {
                    prompt_token_ids: vec![1, 2],
                    output_token_ids: vec![3],
                    stop_token_ids: vec![0, 5],
                }),
            }],
            finished_request_ids: vec!["f".into()],
            kv_connector_metadata: meta.clone(),
            worker_incarnation: Some("1-abc".into()),
        }),
        Message::StepResult(ModelRunnerOutput {
            step_id: 9,
            sampled: vec![SampledToken { request_id: "r".into(), token_id: 3, logprobs: Some(logprobs) }],
            kv_connector_output: kv_out.clone(),
            execute_us: 5,
            failure: None,
        }),
        Message::StepResult(ModelRunnerOutput {
            step_id: 10,
            sampled: vec![],
            kv_connector_output: kv_out.clone(),
            execute_us: 0,
            failure: Some(WireError::new(ErrorClass::Unavailable, "accelerator lost")),
        }),
        Message::ConnectorCalls(vec![
            ConnectorCall::GetNumNewMatchedTokens {
                request_id: "r".into(),
                num_prompt_tokens: 5,
                num_computed_tokens: 0,
                kv_transfer_params: Some(params()),
                prompt_token_ids: vec![1, 2, 3, 4, 5],
            },
            ConnectorCall::UpdateStateAfterAlloc { request_id: "r".into(), block_ids: vec![1], num_external_tokens: 4 },
            ConnectorCall::BuildConnectorMeta { step_id: 1 },
            ConnectorCall::RequestFinished {
                request_id: "r".into(),
                status: FinishedStatus::LengthCapped,
                block_ids: vec![1],
                kv_transfer_params: None,
                block_generations: vec![4],
            },
            ConnectorCall::UpdateConnectorOutput(kv_out),
            ConnectorCall::RequestRejectedBeforeAdmission {
                params: params(),
                rejected_at_unix_us: Some(1),
                trace: Default::default(),
            },
        ]),
        Message::ConnectorReplies(vec![
            ConnectorReply::MatchedTokens { count: Some(4), load_async: true },
            ConnectorReply::Meta(meta),
            ConnectorReply::Finished { delay_free: true, kv_transfer_params: Some(params()) },
            ConnectorReply::Ack,
            ConnectorReply::Rejected { reason: "no".into() },
        ]),
        Message::Ack,
        Message::RejectionNotice(RejectionNotice {
            params: params(),
            data_parallel_rank: Some(1),
            rejected_at_unix_us: Some(5),
            trace: Default::default(),
        }),
        Message::Ping,
        Message::Pong,
        Message::Error(WireError::new(ErrorClass::Unavailable, "engine down")),
        Message::XferGetMetadata,
        Message::XferMetadata(agent_metadata(TransferBackend::Shm { path: "/dev/shm/pdmesh-kv-p-0".into() })),
        Message::XferMetadata(agent_metadata(TransferBackend::Tcp { host: "10.0.0.1".into(), port: 5700 })),
        Message::XferMetadata(agent_metadata(TransferBackend::Cuda {
            ipc_handle: "ab".repeat(64),
            host_boot_id: "6f1e2c3a-0d4b-4c5e-9f60-718293a4b5c6".into(),
        })),
        Message::XferLease(XferLeaseRequest {
            p_request_id: "cmpl-1".into(),
            block_ids: vec![1, 2, 3],
            block_generations: vec![7, 7, 8],
            consumer: "d-0/0".into(),
            capability: "0123456789abcdef0123456789abcdef".into(),
        }),
        Message::XferLeaseGranted(XferLeaseGranted {
            lease_id: u64::MAX - 1,
            lease_ttl_ms: 10_000,
            agent_name: "a-1".into(),
        }),
        Message::XferLeaseRefused(XferLeaseRefused {
            reason: LeaseRefusalReason::GenerationMismatch,
            detail: "block 2: held generation 9".into(),
        }),
        Message::XferReadDone(XferReadDone {
            p_request_id: "cmpl-1".into(),
            lease_id: 3,
            consumer: "d-0/0".into(),
            capability: "c".into(),
        }),
        Message::XferHeartbeat(XferHeartbeat {
            p_request_ids: vec!["a".into(), "b".into()],
            consumer: "d".into(),
            capabilities: vec!["ca".into(), "cb".into()],
        }),
        Message::XferGiveUp(XferGiveUp {
            p_request_id: "cmpl-1".into(),
            reason: "rejected".into(),
            consumer: "d".into(),
            lease_id: Some(3),
            rejected_at_unix_us: Some(1_700_000_000_000_000),
            capability: "c".into(),
        }),
        Message::XferGiveUp(XferGiveUp {
            p_request_id: "x".into(),
            reason: String::new(),
            consumer: String::new(),
            lease_id: None,
            rejected_at_unix_us: None,
            capability: String::new(),
        }),
        Message::XferReadBlocks(XferReadBlocks {
            p_request_id: "cmpl-1".into(),
            lease_id: 3,
            block_ids: vec![3, 1],
            capability: "c".into(),
        }),
        Message::AuthHello(AuthHello { channel: "side_channel".into(), client_nonce: vec![7; 32] }),
        Message::AuthChallenge(AuthChallenge { server_nonce: vec![1; 32], server_proof: vec![2; 32] }),
        Message::AuthProof(AuthProof { client_proof: vec![3; 32] }),
        Message::Error(WireError::new(ErrorClass::Unauthenticated, "authenticate first")),
        Message::XferReadReady(XferReadReady { blocks: 2, bytes: 2 * 737_280 }),
    ]
}

fn agent_metadata(backend: TransferBackend) -> AgentMetadata {
    AgentMetadata {
        engine_id: "p-0".into(),
        agent_name: "0f6b-1234".into(),
        rank: 1,
        backend,
        layout: KV_LAYOUT.into(),
        num_layers: 30,
        num_blocks: 512,
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
        dtype: KV_DTYPE_F32.into(),
        bytes_per_block: 737_280,
        compat_hash: "ab".repeat(32),
        protocol_version: TRANSFER_VERSION,
    }
}

#[test]
fn unknown_lease_refusal_reason_reads_as_other() {
    // A newer producer may refuse for a reason this build does not know.
    #[derive(serde::Serialize)]
    struct NewerRefusal {
        reason: &'static str,
        detail: &'static str,
    }
    let bytes = rmp_serde::to_vec_named(&NewerRefusal { reason: "quota_exceeded", detail: "d" }).unwrap_or_default();
    let back: Result<XferLeaseRefused, _> = rmp_serde::from_slice(&bytes);
    assert!(matches!(&back, Ok(r) if r.reason == LeaseRefusalReason::Other), "{back:?}");
}

#[test]
fn every_message_round_trips() {
    for body in every_message() {
        let kind = body.kind();
        let env = Envelope::new(body).with_request_id("cmpl-1").with_corr(42).with_trace(TraceContext {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            tracestate: Some("vendor=x".into()),
        });
        let bytes = env.encode().unwrap_or_default();
        assert!(!bytes.is_empty(), "{kind} encodes");
        let back = Envelope::decode(&bytes);
        assert!(matches!(&back, Ok(b) if *b == env), "{kind} round-trips: {back:?}");
    }
}

#[test]
fn another_version_is_a_typed_error() {
    let mut env = Envelope::new(Message::Ping);
    env.version = PROTOCOL_VERSION + 1;
    let bytes = rmp_serde::to_vec_named(&env).unwrap_or_default();
    match Envelope::decode(&bytes) {
        Err(CodecError::UnsupportedVersion { found, supported }) => {
            assert_eq!(found, PROTOCOL_VERSION + 1);
            assert_eq!(supported, PROTOCOL_VERSION);
        }
        other => panic!("expected UnsupportedVersion, got {other:?}"),
    }
}

#[test]
fn unknown_message_kind_is_a_typed_error() {
    #[derive(serde::Serialize)]
    struct Foreign {
        version: u16,
        body: std::collections::BTreeMap<String, u32>,
    }
    let mut body = std::collections::BTreeMap::new();
    body.insert("LaunchMissiles".to_string(), 1u32);
    let bytes = rmp_serde::to_vec_named(&Foreign { version: PROTOCOL_VERSION, body }).unwrap_or_default();
    assert!(matches!(Envelope::decode(&bytes), Err(CodecError::Body { .. })));
}

#[test]
fn appended_fields_are_tolerated() {
    // A newer writer may append fields; this reader must ignore them.
    #[derive(serde::Serialize)]
    struct Newer {
        version: u16,
        corr: u64,
        body: Message,
        some_future_field: String,
    }
    let bytes = rmp_serde::to_vec_named(&Newer {
        version: PROTOCOL_VERSION,
        corr: 5,
        body: Message::Pong,
        some_future_field: "x".into(),
    })
    .unwrap_or_default();
    let env = Envelope::decode(&bytes);
    assert!(matches!(env, Ok(Envelope { corr: 5, body: Message::Pong, .. })), "{env:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        // The assertion is that this returns at all (no panic, no abort).
        let _ = Envelope::decode(&bytes);
    }

    #[test]
    fn truncated_frames_are_errors(cut in 0usize..64) {
        let env = Envelope::new(Message::AddRequest(EngineRequest {
            request_id: "x".into(),
            client_request_id: None,
            prompt_token_ids: vec![1; 40],
            sampling: SamplingParams::default(),
            eos_token_ids: vec![],
            arrival_unix_ms: 0,
            kv_transfer_params: None,
            data_parallel_rank: None,
        }));
        let bytes = env.encode().unwrap_or_default();
        let cut = cut.min(bytes.len().saturating_sub(1));
        prop_assert!(Envelope::decode(&bytes[..cut]).is_err());
    }
}
