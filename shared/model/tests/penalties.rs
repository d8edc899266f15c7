//! The sampling parameters of issue 41 on the real model (SmolLM2-135M-Instruct): every step's
//! sampled token is checked against a reference written here from vLLM's definitions, applied
//! to the executor's raw logits of that step (`last_logits`), for the history the step carried.
//! The reference is plain and independent of `pdmesh_model_api::sampling`: a penalty applied in
//! the wrong order, to the wrong ids or with the wrong sign picks another token somewhere.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

mod common;

use std::collections::HashMap;

use pdmesh_model_api::{ChatMessage, Executor, TextCodec};
use pdmesh_protocol::{SamplingHistory, SamplingParams, ScheduledChunk};

/// vLLM's logits processing for a greedy request, written out: allowed ids, bad words,
/// min_tokens, logit_bias, repetition over prompt ∪ output, frequency and presence over output.
fn reference(raw: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32], eos: &[u32]) -> Vec<f32> {
    let mut l = raw.to_vec();
    for w in &p.bad_words_token_ids {
        let (last, rest) = w.split_last().unwrap();
        if output.len() >= rest.len() && output[output.len() - rest.len()..] == rest[..] {
            l[*last as usize] = f32::NEG_INFINITY;
        }
    }
    if (output.len() as u32) < p.min_tokens {
        for &e in eos.iter().chain(&p.stop_token_ids) {
            l[e as usize] = f32::NEG_INFINITY;
        }
    }
    for &(id, b) in &p.logit_bias {
        l[id as usize] += b;
    }
    let mut counts: HashMap<u32, f32> = HashMap::new();
    for &t in output {
        *counts.entry(t).or_default() += 1.0;
    }
    for (id, v) in l.iter_mut().enumerate() {
        let id = id as u32;
        if prompt.contains(&id) || counts.contains_key(&id) {
            if *v > 0.0 {
                *v /= p.repetition_penalty;
            } else {
                *v *= p.repetition_penalty;
            }
        }
        if let Some(&n) = counts.get(&id) {
            *v -= p.frequency_penalty * n + p.presence_penalty;
        }
    }
    l
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy generation of `n` tokens with `params`, one request, the history built as the
/// engine builds it; every step's token is checked against [`reference`]. Returns the tokens.
fn generate(exec: &mut pdmesh_model::GgufExecutor, prompt: &[u32], params: &SamplingParams, n: usize) -> Vec<u32> {
    let eos = exec.facts().eos_token_ids.clone();
    let mut kv = common::kv_cache(exec, 64, 16);
    let mut output: Vec<u32> = Vec::new();
    let mut distinct_prompt = prompt.to_vec();
    distinct_prompt.sort_unstable();
    distinct_prompt.dedup();
    while output.len() < n {
        let (tokens, start) = if output.is_empty() {
            (prompt.to_vec(), 0)
        } else {
            (vec![*output.last().unwrap()], prompt.len() + output.len() - 1)
        };
        let history = SamplingHistory {
            prompt_token_ids: distinct_prompt.clone(),
            output_token_ids: output.clone(),
            stop_token_ids: eos.iter().chain(&params.stop_token_ids).copied().collect(),
        };
        let chunk = ScheduledChunk {
            request_id: "r".into(),
            token_ids: tokens,
            start_pos: start as u32,
            block_ids: (0..64).collect(),
            sample: true,
            sampling: params.clone(),
            output_index: output.len() as u32,
            guided_output: Vec::new(),
            history: Some(history),
        };
        let sampled = exec.execute(&mut kv, &[chunk]).unwrap();
        let token = sampled[0].token_id;
        let want = argmax(&reference(exec.last_logits(), params, prompt, &output, &eos));
        assert_eq!(token, want, "step {}: the sampler and vLLM's definition disagree", output.len());
        output.push(token);
        if eos.contains(&token) {
            break;
        }
    }
    output
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: 1 << 20, ..SamplingParams::default() }
}

#[test]
fn penalties_min_tokens_logit_bias_and_bad_words_follow_vllms_definitions() {
    let Some((mut exec, codec)) = common::load() else { return };
    let eos = exec.facts().eos_token_ids.clone();
    // open text: the common tokens (" the", ",") come back, so penalties have work to do
    let prompt = codec.encode("Once upon a time, in a small village by the sea,").unwrap();
    let plain = generate(&mut exec, &prompt, &greedy(), 32);

    for p in [
        SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.3, ..greedy() },
        SamplingParams { repetition_penalty: 1.3, ..greedy() },
        SamplingParams { repetition_penalty: 0.8, frequency_penalty: -0.5, ..greedy() },
        SamplingParams { presence_penalty: 2.0, ..greedy() },
    ] {
        let out = generate(&mut exec, &prompt, &p, 32);
        assert_ne!(out, plain, "{p:?} changes the greedy text");
    }

    // logit_bias -100 bans the token greedy picks first
    let banned = plain[0];
    let p = SamplingParams { logit_bias: vec![(banned, -100.0)], ..greedy() };
    let out = generate(&mut exec, &prompt, &p, 8);
    assert!(!out.contains(&banned), "{banned} banned, got {out:?}");

    // bad_words: the plain output's first two tokens as one word never appear in that order
    let word = plain[..2].to_vec();
    let p = SamplingParams { bad_words_token_ids: vec![word.clone()], ..greedy() };
    let out = generate(&mut exec, &prompt, &p, 32);
    assert!(!out.windows(2).any(|w| w == word.as_slice()), "{word:?} in {out:?}");

    // min_tokens: a chat the model ends early with EOS goes on to min_tokens
    let chat = codec.render_chat(&[ChatMessage::text("user", "Reply with one word: yes or no?")]).unwrap();
    let chat = codec.encode(&chat).unwrap();
    let short = generate(&mut exec, &chat, &greedy(), 40);
    assert!(
        short.len() < 12 && short.last().is_some_and(|t| eos.contains(t)),
        "the premise: greedy ends with EOS early ({} tokens)",
        short.len()
    );
    let p = SamplingParams { min_tokens: 12, ..greedy() };
    let long = generate(&mut exec, &chat, &p, 12);
    assert_eq!(long.len(), 12, "no EOS before min_tokens: {long:?}");
    assert!(!long.iter().any(|t| eos.contains(t)), "{long:?}");
    assert_eq!(long[..short.len() - 1], short[..short.len() - 1], "the same text up to where EOS was held back");
}
