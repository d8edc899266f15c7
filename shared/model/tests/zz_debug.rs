mod common;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use pdmesh_model_api::{Executor, TextCodec, ChatMessage};
use pdmesh_protocol::ScheduledChunk;

fn top2(l: &[f32]) -> (u32, f32, u32, f32) {
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    (idx[0] as u32, l[idx[0]], idx[1] as u32, l[idx[1]])
}

#[test]
fn debug_stats() {
    let path = common::model_path().unwrap();
    let (mut exec, codec) = pdmesh_model::load_gguf(&path, &Default::default()).unwrap();
    let texts = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):\n", "What is the capital of France?", "Write a haiku about the ocean.", "1, 2, 3, 5, 8, 13, 21,", "Explain gravity to a child.", "List three fruits.", "Who was Ada Lovelace?", "The quick brown fox"];
    let mut max_dev = 0f32; let mut devs = vec![];
    for (pi, t) in texts.iter().enumerate() {
        let prompt = if pi >= 3 { codec.encode(&codec.render_chat(&[ChatMessage{role:"user".into(), content:(*t).into()}]).unwrap()).unwrap() } else { codec.encode(t).unwrap() };
        let mut f = std::fs::File::open(&path).unwrap();
        let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        let mut model = ModelWeights::from_gguf(content, &mut f, &Device::Cpu).unwrap();
        let mut kv = common::kv_cache(&exec, 16, 16);
        let mut seq = prompt.clone();
        let mut pos = 0;
        let mut line = String::new();
        for step in 0..32 {
            let inp = &seq[pos..];
            let mut rl = vec![];
            for (i, &tok) in inp.iter().enumerate() {
                let input = Tensor::new(&[tok], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                rl = model.forward(&input, pos + i).unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap();
            }
            let out = exec.execute(&mut kv, &[ScheduledChunk { request_id: "r".into(), token_ids: inp.to_vec(), start_pos: pos as u32, block_ids: (0..16).collect(), sample: true, sampling: common::greedy(), output_index: step }]).unwrap();
            let ol = exec.last_logits().to_vec();
            let dev = rl.iter().zip(&ol).map(|(a,b)| (a-b).abs()).fold(0f32, f32::max);
            devs.push(dev);
            max_dev = max_dev.max(dev);
            let (r1, v1, _r2, v2) = top2(&rl);
            let agree = out[0].token_id == r1;
            line += &format!("{}{:.3}/{:.2} ", if agree {""} else {"!"}, v1 - v2, dev);
            pos = seq.len();
            seq.push(r1);
        }
        eprintln!("prompt {pi}: {line}");
    }
    devs.sort_by(|a,b| a.total_cmp(b));
    eprintln!("max dev {max_dev}, median {}", devs[devs.len()/2]);
}
