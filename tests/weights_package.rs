//! Packages: import of the real SmolLM2 GGUF (checked against the GGUF's own decode with an
//! independently written row permutation), and a synthetic FastFlowLM-style package (separate
//! q/k/v, 16-lane bf16 tiles, bf16 embeddings).

#[path = "support/smollm2.rs"]
mod smollm2;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use xdna::tiles::{self, ScaleType, TileOrder, WeightFormat};
use xdna::weights::gguf::GgufFile;
use xdna::weights::import::{import_gguf, tokenizer_json, ImportOptions};
use xdna::weights::safetensors::{Declared, Dtype, Writer};
use xdna::weights::tokenizer::{PreTokenizer, Tokenizer};
use xdna::weights::{ChatMessage, MappedBytes, Package, WeightsError};

#[path = "support/scratch_dir.rs"]
mod scratch_dir;

fn scratch(name: &str) -> PathBuf {
    let d = scratch_dir::scratch_path("pkg", name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn smollm() -> Option<PathBuf> {
    smollm2::smollm2_gguf()
}

/// llama.cpp's `permute` (convert_hf_to_gguf.py), written as the reshape it is:
/// w.reshape(n_head, 2, hd/2, K).swapaxes(1, 2).reshape(...): GGUF row → HF row.
fn hf_row_of_gguf_row(gguf_row: usize, rows: usize, n_head: usize) -> usize {
    let hd = rows / n_head;
    // After the swap the index order is (head, p, a) with shape (n_head, hd/2, 2).
    let head = gguf_row / hd;
    let p = (gguf_row % hd) / 2;
    let a = gguf_row % 2;
    // Before the swap it was (head, a, p) with shape (n_head, 2, hd/2).
    head * hd + a * (hd / 2) + p
}

#[test]
fn smollm2_import_matches_the_gguf() {
    let Some(g) = smollm() else { return };
    let dir = scratch("smollm");
    import_gguf(
        &g,
        &dir,
        ImportOptions {
            scale: ScaleType::F16,
            progress: false,
        },
    )
    .unwrap();
    let pkg = Package::open(&dir).unwrap();
    let c = pkg.config();
    assert_eq!(
        (
            c.hidden,
            c.intermediate,
            c.layers,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.vocab
        ),
        (576, 1536, 30, 9, 3, 64, 49152)
    );
    assert_eq!(c.rope_theta, 100000.0);
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        raw["rms_norm_eps"].as_f64(),
        Some(1e-5),
        "written as HF writes it"
    );
    assert_eq!(c.rms_eps, 1e-5);
    assert_eq!(c.max_position_embeddings, 8192);
    assert!(c.tie_word_embeddings);
    assert_eq!(raw["architectures"][0], "LlamaForCausalLM");
    assert!(pkg.fused());
    assert_eq!(pkg.eos_token_ids(), &[2]);
    assert_eq!(pkg.bos_token_id(), Some(1));
    assert!(!pkg.add_bos());
    assert!(pkg.chat_template().unwrap().contains("<|im_start|>"));
    // The template rendered as Hugging Face's apply_chat_template renders it: ChatML, with
    // SmolLM2's default system turn when the conversation has none (expected text written out
    // from the template by hand, and checked with Python's jinja2).
    let user_only = pkg.render_chat(&[ChatMessage::new("user", "Hi")]).unwrap();
    assert_eq!(
        user_only,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let turns = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "Bye"),
    ];
    assert_eq!(
        pkg.render_chat(&turns).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(pkg.tokenizer().pre_tokenizer(), PreTokenizer::SmolLm);
    assert_eq!(pkg.lm_head_name(), "model.embed_tokens.weight");

    let f = GgufFile::open(&g).unwrap();
    // Embedding rows: exact Q8_0 decode.
    let e = f.tensor("token_embd.weight").unwrap();
    let (mut got, mut want) = (vec![0f32; 576], vec![0f32; 576]);
    for tok in [0u32, 1, 2, 1234, 49151] {
        pkg.embedding_row(tok, &mut got).unwrap();
        e.decode_row(tok as usize, &mut want).unwrap();
        assert_eq!(got, want, "token {tok}");
    }
    assert!(pkg.embedding_row(49152, &mut got).is_err());
    let head = pkg.lm_head().unwrap();
    assert_eq!((head.rows, head.cols), (49152, 576));
    assert!(matches!(
        head.format,
        WeightFormat::Q8 {
            scale: ScaleType::F16,
            ..
        }
    ));

    // Fused QKV of layer 3: q rows un-permuted, then k rows un-permuted, then v as is.
    let qkv = pkg
        .matrix("model.layers.3.self_attn.qkv_proj.weight", 960, 576)
        .unwrap();
    assert_eq!(
        qkv.format,
        WeightFormat::Q41 {
            scale: ScaleType::F16,
            order: TileOrder::ColumnMajor
        }
    );
    let all = qkv.decode_f32().unwrap();
    for (src, base, rows, heads) in [
        ("attn_q", 0, 576, Some(9)),
        ("attn_k", 576, 192, Some(3)),
        ("attn_v", 768, 192, None),
    ] {
        let t = f
            .tensor(&format!("blk.3.{src}.weight"))
            .unwrap()
            .decode_f32()
            .unwrap();
        for gr in 0..rows {
            let hr = heads.map(|h| hf_row_of_gguf_row(gr, rows, h)).unwrap_or(gr);
            assert_eq!(
                &all[(base + hr) * 576..(base + hr + 1) * 576],
                &t[gr * 576..(gr + 1) * 576],
                "{src} row {gr}"
            );
        }
    }
    // gate_up: gate rows then up rows; down: K = 1536.
    let gu = pkg
        .matrix("model.layers.29.mlp.gate_up_proj.weight", 3072, 576)
        .unwrap()
        .decode_f32()
        .unwrap();
    let up = f
        .tensor("blk.29.ffn_up.weight")
        .unwrap()
        .decode_f32()
        .unwrap();
    assert_eq!(&gu[1536 * 576..], &up[..]);
    let down = pkg
        .matrix("model.layers.0.mlp.down_proj.weight", 576, 1536)
        .unwrap()
        .decode_f32()
        .unwrap();
    assert_eq!(
        down,
        f.tensor("blk.0.ffn_down.weight")
            .unwrap()
            .decode_f32()
            .unwrap()
    );
    // Norms are exact f32.
    assert_eq!(
        pkg.vector("model.layers.7.post_attention_layernorm.weight")
            .unwrap(),
        f.tensor("blk.7.ffn_norm.weight")
            .unwrap()
            .decode_f32()
            .unwrap()
    );
    // Shape validation names the problem.
    let m = pkg
        .matrix("model.layers.3.self_attn.qkv_proj.weight", 576, 576)
        .unwrap_err()
        .to_string();
    assert!(m.contains("qkv_proj") && m.contains("960"), "{m}");
    assert!(pkg
        .matrix("model.layers.3.self_attn.q_proj.weight", 576, 576)
        .is_err());
    assert!(!pkg.has_tensor("lm_head.weight"));

    // tokenizer.json in the package encodes like the GGUF tokenizer.
    let gt = Tokenizer::from_gguf(&f).unwrap();
    let text = "<|im_start|>user\nWhat is 2+2? 🦀<|im_end|>";
    assert_eq!(pkg.tokenizer().encode(text, true), gt.encode(text, true));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gguf_path_is_imported_once_into_the_cache() {
    let Some(g) = smollm() else { return };
    let cache = scratch("cache");
    // SAFETY: the other tests of this binary touch the environment only through std::env (whose
    // own lock orders them with this write); nothing here reads it through libc directly.
    unsafe { std::env::set_var("XDG_CACHE_HOME", &cache) };
    let a = Package::open(&g).unwrap();
    let dir = a.dir().to_path_buf();
    assert!(dir.starts_with(cache.join("xdna").join("packages")));
    let mtime = std::fs::metadata(dir.join("model.q4nx"))
        .unwrap()
        .modified()
        .unwrap();
    let b = Package::open(&g).unwrap();
    assert_eq!(b.dir(), dir);
    assert_eq!(
        std::fs::metadata(dir.join("model.q4nx"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime,
        "reused, not rewritten"
    );
    // The import records where it came from, so the cache can drop it once the file is gone.
    let record = dir.with_file_name(format!(
        "{}.sources",
        dir.file_name().unwrap().to_string_lossy()
    ));
    let sources = std::fs::read_to_string(&record).unwrap();
    let canonical = std::fs::canonicalize(&g).unwrap();
    assert_eq!(
        sources.lines().collect::<Vec<_>>(),
        [canonical.to_str().unwrap()]
    );
    // No temporary directories are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
    let _ = std::fs::remove_dir_all(&cache);
}

fn tiny_tokenizer(dir: &Path) -> Tokenizer {
    let table = xdna::weights::tokenizer::byte_to_char_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    tokens.push("he".into());
    tokens.push("<|im_end|>".into());
    let t = Tokenizer::new(
        dir,
        tokens,
        &[("h".into(), "e".into())],
        &[(257, true)],
        PreTokenizer::Gpt2,
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&tokenizer_json(&t)).unwrap(),
    )
    .unwrap();
    t
}

#[test]
#[allow(clippy::needless_range_loop)] // (tile, group, row) indices mirror the tile layout
fn flm_style_package_loads_unfused() {
    let dir = scratch("flm");
    let (hidden, layers, heads, kv, hd, vocab) =
        (256usize, 1usize, 4usize, 2usize, 64usize, 64usize);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": true,
            "flm_version": "0.9.20", "addr_qk": 0, "addr_kv": 0
        }))
        .unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>", "eos_token_id": [257], "add_bos_token": false, "chat_template": "{{ x }}"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "FILE WINS").unwrap();
    let tok = tiny_tokenizer(&dir);
    // q: 256 x 256 → 8 tiles in 16-lane order with bf16 scales; every cell has 0 and 15.
    let lanes = TileOrder::Lanes16;
    // Like real q4_1 data: each (group, row) cell has one 0 and one 15, the rest in 1..=14.
    let mut state = 0x1234_5678_9ABC_DEF1u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut q = vec![0u8; 8 * tiles::Q41_TILE_BYTES];
    let mut code_of = vec![[[[0u8; 32]; 32]; 8]; 8]; // [tile][g][r][i]
    for (ti, tile) in q.chunks_exact_mut(tiles::Q41_TILE_BYTES).enumerate() {
        for g in 0..8 {
            for r in 0..32 {
                let mut codes: [u8; 32] = std::array::from_fn(|_| 1 + (next() % 14) as u8);
                let lo = (next() % 32) as usize;
                codes[lo] = 0;
                codes[(lo + 1 + (next() % 31) as usize) % 32] = 15;
                code_of[ti][g][r] = codes;
                tiles::set_q41_cell(tile, ScaleType::Bf16, lanes, g, r, 0.5, -4.0, &codes);
            }
        }
    }
    let emb: Vec<u8> = (0..vocab * hidden)
        .flat_map(|i| {
            half::bf16::from_f32((i % 7) as f32 - 3.0)
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    let norm: Vec<u8> = (0..hidden)
        .flat_map(|_| half::bf16::from_f32(1.0).to_bits().to_le_bytes())
        .collect();
    let decl = [
        Declared {
            name: "model.embed_tokens.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![vocab, hidden],
        },
        Declared {
            name: "model.layers.0.input_layernorm.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![hidden],
        },
        Declared {
            name: "model.layers.0.self_attn.q_proj.weight".into(),
            dtype: Dtype::I8,
            shape: vec![8, 5120],
        },
        Declared {
            name: "model.layers.0.self_attn.k_proj.weight".into(),
            dtype: Dtype::I8,
            shape: vec![4, 1, 5120], // 3-D grid [out/32, in/256, chunk]
        },
    ];
    let mut w = Writer::create(dir.join("model.q4nx"), &decl, &BTreeMap::new()).unwrap();
    w.write("model.embed_tokens.weight", &emb).unwrap();
    w.write("model.layers.0.input_layernorm.weight", &norm)
        .unwrap();
    w.write("model.layers.0.self_attn.q_proj.weight", &q)
        .unwrap();
    w.write("model.layers.0.self_attn.k_proj.weight", &q[..4 * 5120])
        .unwrap();
    w.finish().unwrap();

    let pkg = Package::open(dir.join("model.q4nx")).unwrap();
    assert!(!pkg.fused());
    assert_eq!(pkg.chat_template(), Some("FILE WINS"));
    assert_eq!(pkg.render_chat(&[]).unwrap(), "FILE WINS");
    assert_eq!(pkg.eos_token_ids(), &[257]);
    assert_eq!(pkg.bos_token_id(), None);
    assert_eq!(pkg.weights().tile_order(), lanes);
    let m = pkg
        .matrix("model.layers.0.self_attn.q_proj.weight", 256, 256)
        .unwrap();
    assert_eq!(
        m.format,
        WeightFormat::Q41 {
            scale: ScaleType::Bf16,
            order: lanes
        }
    );
    let mut row = vec![0f32; 256];
    m.decode_row(37, &mut row).unwrap();
    // Row 37 = tile row block 1 (tiles 0 of p=1 → ti = 1), r = 5.
    for (c, &v) in row.iter().enumerate() {
        let want = code_of[1][c / 32][5][c % 32] as f32 * 0.5 - 4.0;
        assert_eq!(v, want, "col {c}");
    }
    // The 3-D grid: same tiles, logical [128, 256]; dims checked, not only the byte count.
    let k = pkg
        .matrix("model.layers.0.self_attn.k_proj.weight", 128, 256)
        .unwrap();
    let mut krow = vec![0f32; 256];
    k.decode_row(37, &mut krow).unwrap();
    assert_eq!(krow, row);
    let err = pkg
        .matrix("model.layers.0.self_attn.k_proj.weight", 64, 512)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("k_proj") && err.contains("[4, 1, 5120]"),
        "{err}"
    );
    assert!(pkg
        .matrix("model.layers.0.self_attn.k_proj.weight", 256, 256)
        .is_err());
    let mut e = vec![0f32; hidden];
    pkg.embedding_row(3, &mut e).unwrap();
    assert_eq!(e[0], ((3 * hidden) % 7) as f32 - 3.0);
    // A matrix held in place: the same bytes, for as long as the holder lives; bytes outside the
    // package's mapping are refused, naming the file.
    let k_bytes = k.data.to_vec();
    let k_range = k.data.as_ptr() as usize..k.data.as_ptr() as usize + k.data.len();
    let pkg = std::sync::Arc::new(pkg);
    let k = pkg
        .matrix("model.layers.0.self_attn.k_proj.weight", 128, 256)
        .unwrap();
    let held = MappedBytes::new(&pkg, k.data).unwrap();
    assert_eq!(held[..], k_bytes[..]);
    assert_eq!(
        held.as_ptr() as usize..held.as_ptr() as usize + held.len(),
        k_range
    );
    let elsewhere = vec![0u8; 16];
    let err = MappedBytes::new(&pkg, &elsewhere).unwrap_err().to_string();
    assert!(err.contains("model.q4nx"), "{err}");
    assert_eq!(
        pkg.vector("model.layers.0.input_layernorm.weight").unwrap(),
        vec![1.0; hidden]
    );
    assert_eq!(
        pkg.tokenizer().encode("hehe<|im_end|>", true),
        tok.encode("hehe<|im_end|>", true)
    );
    assert_eq!(
        pkg.tokenizer().encode("hehe<|im_end|>", true),
        vec![256, 256, 257]
    );
    // No BOS in the metadata: prompts are the text's tokens alone.
    assert_eq!(pkg.leading_bos(), None);
    assert_eq!(pkg.encode_prompt("hehe", false), vec![256, 256]);
    // With `add_bos_token` and a BOS token (257 here): one BOS first, and none added to special
    // text that already starts with it (a rendered chat template that writes its own).
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>", "bos_token": "<|im_end|>", "add_bos_token": true}"#,
    )
    .unwrap();
    let pkg = Package::open(dir.join("model.q4nx")).unwrap();
    assert_eq!(pkg.leading_bos(), Some(257));
    assert_eq!(pkg.encode_prompt("hehe", false), vec![257, 256, 256]);
    assert_eq!(pkg.encode_prompt("<|im_end|>he", true), vec![257, 256]);
    assert_eq!(pkg.encode_prompt("he<|im_end|>", true), vec![257, 256, 257]);
    // The template's own refusal and a template that does not parse are errors naming the
    // package; so is rendering a chat for a package without a template.
    let chat = [ChatMessage::new("user", "he")];
    for (template, says) in [
        (
            "{{ raise_exception('roles must alternate') }}",
            "roles must alternate",
        ),
        ("{% for %}", "syntax error"),
    ] {
        std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
        let pkg = Package::open(dir.join("model.q4nx")).unwrap();
        let err = pkg.render_chat(&chat).unwrap_err();
        assert!(matches!(err, WeightsError::ChatTemplate { .. }), "{err}");
        assert!(err.to_string().contains(says), "{err}");
        assert!(err.to_string().contains(&*dir.to_string_lossy()), "{err}");
    }
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    let pkg = Package::open(dir.join("model.q4nx")).unwrap();
    let err = pkg.render_chat(&chat).unwrap_err().to_string();
    assert!(err.contains("no chat template"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_import_cache_keeps_what_live_files_reach() {
    use xdna::weights::import::{cache_key, prune_import_cache, IMPORT_REVISION};
    let root = scratch("prune");
    let packages = root.join("packages");
    std::fs::create_dir_all(&packages).unwrap();
    let live = root.join("live.gguf");
    std::fs::write(&live, b"GGUF live").unwrap();
    let changed = root.join("changed.gguf");
    std::fs::write(&changed, b"GGUF before").unwrap();
    let changed_key = cache_key(&changed).unwrap();
    std::fs::write(&changed, b"GGUF after, longer").unwrap();
    let entry = |name: &str, sources: Option<&[&Path]>| {
        std::fs::create_dir_all(packages.join(name)).unwrap();
        std::fs::write(packages.join(name).join("model.q4nx"), b"x").unwrap();
        if let Some(sources) = sources {
            let text: String = sources
                .iter()
                .map(|p| format!("{}\n", p.display()))
                .collect();
            std::fs::write(packages.join(format!("{name}.sources")), text).unwrap();
        }
    };
    let live_key = cache_key(&live).unwrap();
    let gone = root.join("gone.gguf");
    entry(&live_key, Some(&[gone.as_path(), live.as_path()]));
    entry("gone-9-9-r2", Some(&[gone.as_path()]));
    entry(&changed_key, Some(&[changed.as_path()]));
    entry("older-1-1-r0", None);
    let unrecorded = format!("unrecorded-1-1-r{IMPORT_REVISION}");
    entry(&unrecorded, None);
    std::fs::create_dir_all(packages.join(".in-progress.tmp.1.0")).unwrap();

    let mut removed: Vec<String> = prune_import_cache(&packages)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    removed.sort();
    let mut expected = vec![
        changed_key.clone(),
        "gone-9-9-r2".into(),
        "older-1-1-r0".into(),
    ];
    expected.sort();
    assert_eq!(removed, expected);
    let mut left: Vec<String> = std::fs::read_dir(&packages)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let mut kept = vec![
        ".in-progress.tmp.1.0".to_string(),
        live_key.clone(),
        format!("{live_key}.sources"),
        unrecorded,
    ];
    kept.sort();
    assert_eq!(left, kept);
    let _ = std::fs::remove_dir_all(&root);
}
