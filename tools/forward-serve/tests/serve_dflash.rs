//! forward-serve with a DFlash draft (`--draft`) on the real SmolLM2-135M-Instruct.
//!
//! The draft is a random-weight generation-1 DFlash GGUF for the default model, written by
//! llama.cpp's own writer (`tools/llama-cpp/random_gguf.py --arch dflash`, gguf-py beside the
//! llama.cpp programs of `XDNA_LLAMA_CPP_BIN`). Its drafts are almost never accepted, so output
//! equal to plain greedy decoding says little about the draft's context; the engine-level tests
//! check that directly: every sequence's draft holds exactly its committed positions, and its
//! drafts equal those of a `DflashDraft` fed the target's own passes over the same tokens (rounds
//! that keep 1 to 16 rows, two sequences sharing each pass, starts from the prefix cache and
//! copies of one prompt). Without llama.cpp or the default model the tests skip loudly; under CI
//! they fail.

mod serve_common;
#[path = "../../../tests/support/smollm2.rs"]
mod smollm2;

use forward_serve::api::Config;
use forward_serve::engine::{Engine, LoadSpec, Loaded, PrefillItem, SeqId, SequenceStart};
use serde_json::{json, Value};
use serve_common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use xdna::cli::ModelArgs;
use xdna::model::dflash::{DflashDraft, DflashWeights};
use xdna::model::load::{open_model, open_package, Backend, LoadOptions};
use xdna::model::Model;

/// llama.cpp's gguf-py (beside `XDNA_LLAMA_CPP_BIN`); under CI its absence fails the test.
fn gguf_py() -> Option<PathBuf> {
    match std::env::var_os("XDNA_LLAMA_CPP_BIN") {
        Some(d) => Some(PathBuf::from(d).parent()?.join("gguf-py")),
        None if std::env::var_os("CI").is_some() => {
            panic!("XDNA_LLAMA_CPP_BIN is unset under CI (.ci/run builds llama.cpp and sets it)")
        }
        None => {
            eprintln!("\n!!!!!!!! SKIPPED: llama.cpp's gguf-py unavailable; run tools/llama-cpp/build.sh and set XDNA_LLAMA_CPP_BIN !!!!!!!!\n");
            None
        }
    }
}

/// A random DFlash draft for the default model (hidden 576, 9/3 heads of 64, 1536 MLP) with
/// `random_gguf.py --arch dflash` and the shape arguments `shape`.
fn random_draft(target: &Path, name: &str, shape: &[&str]) -> Option<PathBuf> {
    let gguf_py = gguf_py()?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../llama-cpp/random_gguf.py");
    let (out, tmp) = kept_file(
        &format!("{name}-{shape:?}-{}", target.display()),
        &[Path::new(script)],
    );
    if out.is_file() {
        return Some(out);
    }
    let run = Command::new("python3")
        .arg(script)
        .args([
            "--arch",
            "dflash",
            "--rope-base",
            "100000",
            "--rms-eps",
            "1e-5",
        ])
        .args(shape)
        .arg("--tokenizer-from")
        .arg(target)
        .arg("--out")
        .arg(&tmp)
        .env("PYTHONPATH", &gguf_py)
        .output()
        .expect("run python3");
    assert!(
        run.status.success(),
        "random_gguf.py --arch dflash failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::rename(&tmp, &out).expect("rename the draft into place");
    Some(out)
}

/// Where a generated file is kept between runs — named by `what` and the bytes of the
/// `sources` that write it, so that a run reuses both the file and its import in the package
/// cache (a new file each run would be imported anew each run) — and the temporary name it is
/// written under first (renamed into place: parallel runs never see half a file).
fn kept_file(what: &str, sources: &[&Path]) -> (PathBuf, PathBuf) {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    what.hash(&mut h);
    for s in sources {
        std::fs::read(s).expect("read a source").hash(&mut h);
    }
    let key = h.finish();
    let dir = std::env::temp_dir();
    (
        dir.join(format!("forward-serve-dflash-{key:016x}.gguf")),
        dir.join(format!(
            "forward-serve-dflash-{key:016x}.{}.tmp.gguf",
            std::process::id()
        )),
    )
}

const SHAPE: [&str; 10] = [
    "--hidden",
    "576",
    "--heads",
    "9",
    "--kv-heads",
    "3",
    "--head-dim",
    "64",
    "--ffn",
    "1536",
];

/// The default model and a draft for it, made once per test binary.
fn model_and_draft() -> Option<(PathBuf, PathBuf)> {
    static DRAFT: OnceLock<Option<(PathBuf, PathBuf)>> = OnceLock::new();
    DRAFT
        .get_or_init(|| {
            let gguf = smollm2::smollm2_gguf()?;
            let draft = random_draft(&gguf, "fit", &SHAPE)?;
            // Imported into the package cache once, here: the tests' loaders open it in
            // parallel, and two imports of one file in one process share a temporary directory.
            open_package(&draft).expect("the draft imports");
            Some((gguf, draft))
        })
        .clone()
}

/// The server's loader on the host backend: `ctx` positions, 16 sequences, a prefix cache of
/// `prefix_cache`, the draft `draft`.
fn load(model: &Path, draft: Option<&Path>, ctx: usize, prefix_cache: usize) -> Loaded {
    forward_serve::engine::load(&LoadSpec {
        model: ModelArgs {
            path: Some(model.to_path_buf()),
            backend: Backend::Host,
            kernels: None,
        },
        ctx,
        max_sequences: 16,
        prefix_cache,
        draft: draft.map(Path::to_path_buf),
    })
    .expect("load")
}

async fn load_async(model: &Path, draft: &Path, ctx: usize, prefix_cache: usize) -> Loaded {
    let (m, d) = (model.to_path_buf(), draft.to_path_buf());
    tokio::task::spawn_blocking(move || load(&m, Some(&d), ctx, prefix_cache))
        .await
        .expect("join")
}

async fn stop_server(
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), forward_serve::server::ServeError>>,
) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(60), server)
        .await
        .expect("stop")
        .expect("join")
        .expect("clean stop");
}

async fn completion(addr: std::net::SocketAddr, body: Value) -> Value {
    let r = post_json(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

async fn greedy(addr: std::net::SocketAddr, prompt: &str, n: usize, spec: Value) -> String {
    let v = completion(
        addr,
        json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "speculative": spec}),
    )
    .await;
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

fn drafter_metric(body: &str, name: &str, drafter: &str) -> f64 {
    metric(
        body,
        &format!("forward_serve_speculative_drafter_{name}{{drafter=\"{drafter}\"}}"),
    )
    .unwrap_or_else(|| panic!("no {name} for {drafter}:\n{body}"))
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
];

/// Greedy completions drafting with DFlash equal the same requests without it: each alone
/// (completions, streamed, chat, an echoed prompt with log-probabilities), then DFlash, n-gram
/// and plain requests all at once, sharing passes. /metrics counts the DFlash rounds, and no
/// proposal was refused (each draft's context followed its sequence through every commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dflash_greedy_equals_plain_alone_and_mixed_with_ngram_and_plain() {
    let Some((model, draft)) = model_and_draft() else {
        return;
    };
    let t0 = Instant::now();
    let cfg = Config {
        request_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let (addr, stop, server) = serve_loaded(load_async(&model, &draft, 512, 0).await, cfg).await;
    let n = 24;
    let dflash = json!({"drafter": "dflash"});
    let mut plain = Vec::new();
    for p in PROMPTS {
        let want = greedy(addr, p, n, json!(false)).await;
        let got = greedy(addr, p, n, dflash.clone()).await;
        eprintln!("{p:?} -> {want:?}");
        assert_eq!(got, want, "{p:?}: DFlash alone vs plain");
        plain.push(want);
    }
    let body = get(addr, "/metrics").await.text();
    let rounds_alone = drafter_metric(&body, "rounds_total", "dflash");
    assert!(
        rounds_alone >= (PROMPTS.len() * (n - 2)) as f64,
        "every decode pass of a DFlash request alone drafts: {rounds_alone}"
    );
    // Streamed, and chat.
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": PROMPTS[0], "max_tokens": n, "temperature": 0, "stream": true, "speculative": {"drafter": "dflash", "draft_max": 15}}),
    )
    .await;
    let text: String = r
        .sse()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, plain[0], "streamed");
    let chat = |spec: Value| json!({"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16, "temperature": 0, "speculative": spec});
    let a = post_json(addr, "/v1/chat/completions", &chat(json!(false)))
        .await
        .json();
    let b = post_json(addr, "/v1/chat/completions", &chat(dflash.clone()))
        .await
        .json();
    assert_eq!(
        a["choices"][0]["message"], b["choices"][0]["message"],
        "chat"
    );
    // An echoed prompt with log-probabilities reads every prompt row (the prefill that hands
    // back every row's logits) and then drafts.
    let echo = |spec: Value| json!({"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "echo": true, "logprobs": 1, "speculative": spec});
    let a = completion(addr, echo(json!(false))).await;
    let b = completion(addr, echo(dflash.clone())).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "echo");
    assert_eq!(
        a["choices"][0]["logprobs"]["tokens"],
        b["choices"][0]["logprobs"]["tokens"]
    );
    // All at once: DFlash, n-gram and plain sequences in the same passes.
    let before = get(addr, "/metrics").await.text();
    let tasks: Vec<_> = PROMPTS
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            [
                json!({"drafter": "dflash", "draft_max": 4 + 5 * i}),
                json!({"drafter": "ngram"}),
                json!(false),
                json!({"drafter": "dflash"}),
            ]
            .map(|s| (i, p.to_string(), s))
        })
        .map(|(i, p, s)| tokio::spawn(async move { (i, s.clone(), greedy(addr, &p, n, s).await) }))
        .collect();
    for t in tasks {
        let (i, s, text) = t.await.expect("join");
        assert_eq!(text, plain[i], "prompt {i} with {s} in a mixed batch");
    }
    let body = get(addr, "/metrics").await.text();
    let delta = |name: &str, drafter: &str| {
        drafter_metric(&body, name, drafter) - drafter_metric(&before, name, drafter)
    };
    let (rounds, drafted) = (
        delta("rounds_total", "dflash"),
        delta("drafted_total", "dflash"),
    );
    eprintln!(
        "mixed: dflash {rounds} rounds, {drafted} drafts; ngram {} rounds; tau(dflash) {}",
        delta("rounds_total", "ngram"),
        drafter_metric(&body, "tau", "dflash")
    );
    assert!(rounds > 0.0 && drafted >= rounds, "{body}");
    assert!(delta("rounds_total", "ngram") > 0.0, "{body}");
    assert_eq!(
        drafter_metric(&body, "errors_total", "dflash"),
        0.0,
        "{body}"
    );
    assert!(drafter_metric(&body, "tau", "dflash") >= 1.0, "{body}");
    stop_server(stop, server).await;
    eprintln!("took {:.1} s", t0.elapsed().as_secs_f64());
}

/// A DFlash request starts from the prefix cache only where the cached state kept its draft
/// context rows (a DFlash sequence's), and samples of one prompt copy their leader's: a chat's
/// second turn takes most of its prompt from the first turn's state, `n` = 3 samples share one
/// prompt read, and a state a plain request left serves a plain request but not a DFlash one.
/// Outputs equal those of a server without the cache; no proposal is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dflash_requests_start_from_cached_prefixes_and_shared_samples() {
    let Some((model, draft)) = model_and_draft() else {
        return;
    };
    let t0 = Instant::now();
    let cfg = || Config {
        request_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let (warm, stop_warm, warm_server) =
        serve_loaded(load_async(&model, &draft, 2048, 4).await, cfg()).await;
    let (cold, stop_cold, cold_server) =
        serve_loaded(load_async(&model, &draft, 2048, 0).await, cfg()).await;
    let dflash = json!({"drafter": "dflash", "draft_max": 6});
    let chat = |messages: &Value| json!({"messages": messages, "max_tokens": 10, "temperature": 0, "speculative": dflash});
    let to_json = |m: &[forward_serve::engine::ChatMessage]| -> Value {
        m.iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect()
    };
    // About 400 tokens of history.
    let history = forward_serve::bench::long_chat("dflash", 60);
    let first = post_json(warm, "/v1/chat/completions", &chat(&to_json(&history)))
        .await
        .json();
    let reply = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let messages = to_json(&forward_serve::bench::second_turn(history, &reply));
    let before = get(warm, "/metrics").await.text();
    let second = post_json(warm, "/v1/chat/completions", &chat(&messages))
        .await
        .json();
    let after = get(warm, "/metrics").await.text();
    let second_cold = post_json(cold, "/v1/chat/completions", &chat(&messages))
        .await
        .json();
    assert_eq!(second["choices"], second_cold["choices"], "warm vs cold");
    let delta =
        |name: &str| metric(&after, name).unwrap_or(0.0) - metric(&before, name).unwrap_or(0.0);
    let prompt_tokens = second["usage"]["prompt_tokens"].as_f64().unwrap_or(0.0);
    let reused = delta("forward_serve_prefix_cache_tokens_total");
    eprintln!("second turn: {reused} of {prompt_tokens} prompt tokens from the cache");
    assert!(
        prompt_tokens > 200.0 && reused > 0.8 * prompt_tokens,
        "{reused} of {prompt_tokens}"
    );
    let rounds = drafter_metric(&after, "rounds_total", "dflash")
        - drafter_metric(&before, "rounds_total", "dflash");
    assert!(rounds > 0.0, "the second turn drafted: {after}");

    // n = 3 sampled DFlash samples of one prompt: the later two copy the first's state and
    // draft context; each equals the n = 1 request with its seed on the cold server (4 drafts a
    // round either way, so that their rounds draw the same uniforms).
    let body = |n: usize, seed: u64| json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": seed, "n": n, "speculative": {"drafter": "dflash", "draft_max": 4}});
    let before = get(warm, "/metrics").await.text();
    let many = completion(warm, body(3, 42)).await;
    let after = get(warm, "/metrics").await.text();
    let shared = metric(&after, "forward_serve_shared_prompt_samples_total").unwrap_or(0.0)
        - metric(&before, "forward_serve_shared_prompt_samples_total").unwrap_or(0.0);
    assert_eq!(shared, 2.0, "two samples copied the first");
    for i in 0..3 {
        let one = completion(cold, body(1, 42 + i)).await;
        assert_eq!(
            many["choices"][i as usize]["text"], one["choices"][0]["text"],
            "sample {i}"
        );
    }

    // A plain request's state serves a plain request, not a DFlash one (it has no context rows).
    let prompt = "A plain request leaves this prompt in the cache, and a DFlash one reads it cold.";
    let hits = |body: &str| metric(body, "forward_serve_prefix_cache_hits_total").unwrap_or(0.0);
    let h0 = hits(&get(warm, "/metrics").await.text());
    greedy(warm, prompt, 4, json!(false)).await;
    let with_dflash = greedy(warm, &format!("{prompt} Then"), 4, dflash.clone()).await;
    let h1 = hits(&get(warm, "/metrics").await.text());
    assert_eq!(
        h1, h0,
        "a DFlash request started from a plain request's state"
    );
    let plain = greedy(warm, &format!("{prompt} Then"), 4, json!(false)).await;
    let h2 = hits(&get(warm, "/metrics").await.text());
    assert!(h2 > h1, "the plain request read its prompt cold");
    assert_eq!(with_dflash, plain);
    let body = get(warm, "/metrics").await.text();
    assert_eq!(
        drafter_metric(&body, "errors_total", "dflash"),
        0.0,
        "{body}"
    );
    for (stop, server) in [(stop_warm, warm_server), (stop_cold, cold_server)] {
        stop_server(stop, server).await;
    }
    eprintln!("took {:.1} s", t0.elapsed().as_secs_f64());
}

/// The target's passes as the engine runs them, replayed on a model of its own, feeding a
/// `DflashDraft` of its own: the drafts the engine proposes must be that draft's.
struct Reference {
    model: Model,
    draft: DflashDraft,
    taps: Vec<usize>,
}

impl Reference {
    fn new(model_path: &Path, draft: &Arc<DflashWeights>) -> Reference {
        let opts = LoadOptions {
            backend: Backend::Host,
            kernels: None,
            exact: false,
        };
        let (_, model) = open_model(Some(model_path), 512, &opts).expect("target");
        let d = DflashDraft::new(draft.clone(), model.weights_arc()).expect("bind");
        Reference {
            taps: draft.params().target_layers.clone(),
            model,
            draft: d,
        }
    }

    fn prefill(&mut self, tokens: &[u32]) {
        let taps = self.taps.clone();
        let mut chunks = Vec::new();
        self.model
            .prefill_tapped(tokens, &taps, &mut |out| {
                let mut f = Vec::new();
                for r in 0..out.rows() {
                    for t in 0..taps.len() {
                        f.extend_from_slice(out.tap(t, r));
                    }
                }
                chunks.push((f, out.rows()));
            })
            .expect("prefill");
        for (f, rows) in chunks {
            self.draft.push_context(&f, rows).expect("push context");
        }
    }

    /// One verify pass over `tokens`, keeping `n` rows.
    fn step(&mut self, tokens: &[u32], n: usize) {
        let taps = self.taps.clone();
        let out = self.model.step_batch_all(tokens, &taps).expect("step");
        let mut f = Vec::new();
        for r in 0..n {
            for t in 0..taps.len() {
                f.extend_from_slice(out.tap(t, r));
            }
        }
        self.model.commit_verify_rows(n).expect("commit");
        self.draft.push_context(&f, n).expect("push context");
    }

    fn drafts(&mut self, pending: u32, k: usize) -> Vec<u32> {
        let mut drafts = Vec::new();
        self.draft
            .block_drafts(pending, &mut drafts)
            .expect("block");
        drafts.truncate(k);
        drafts
    }
}

fn argmax(row: &[f32]) -> u32 {
    xdna::model::sampling::argmax(row, 0).expect("finite logits")
}

/// Prefill every `(seq, prompt)` in one shared pass; each sequence's next-token argmax.
fn prefill_all(engine: &mut dyn Engine, items: &[(SeqId, &[u32])]) -> Vec<u32> {
    let chunks: Vec<PrefillItem<'_>> = items
        .iter()
        .map(|&(seq, tokens)| PrefillItem {
            seq,
            tokens,
            last: true,
            all_rows: false,
        })
        .collect();
    let mut next = vec![0; items.len()];
    engine
        .prefill_many(&chunks, &mut |i, _, logits| next[i] = argmax(logits))
        .expect("prefill");
    next
}

/// The engine's DFlash drafts equal a reference draft's fed by the target's own passes over the
/// same tokens: two sequences sharing every prefill and verify pass, rounds keeping 1..=16 rows
/// (whatever the drafts were: the test decides what is kept), the draft's context equal to the
/// committed positions after every commit.
#[test]
fn engine_drafts_equal_a_draft_fed_the_targets_own_passes() {
    let Some((model, draft_path)) = model_and_draft() else {
        return;
    };
    let t0 = Instant::now();
    let Loaded { codec, mut engine } = load(&model, Some(&draft_path), 512, 0);
    let draft_pkg = open_package(&draft_path).expect("draft");
    let weights = Arc::new(DflashWeights::load(&draft_pkg, false).expect("weights"));
    let prompts = [
        codec.prompt_tokens(PROMPTS[0], false).expect("tokens"),
        codec
            .prompt_tokens("Rust is a language that", false)
            .expect("tokens"),
    ];
    let start = SequenceStart {
        reuse_prefix: false,
        dflash: true,
    };
    let seqs: Vec<SeqId> = prompts
        .iter()
        .map(|p| engine.start_sequence(p, start).expect("start").0)
        .collect();
    let mut refs: Vec<Reference> = (0..2).map(|_| Reference::new(&model, &weights)).collect();
    let mut pending = prefill_all(
        &mut *engine,
        &[(seqs[0], &prompts[0]), (seqs[1], &prompts[1])],
    );
    for (r, p) in refs.iter_mut().zip(&prompts) {
        r.prefill(p);
    }
    let mut compared = 0;
    // Drafts per sequence each round (`None`: it sits the round out); at most 16 rows a pass.
    let rounds: [[Option<usize>; 2]; 9] = [
        [Some(7), Some(3)],
        [Some(14), Some(0)],
        [Some(1), Some(6)],
        [Some(4), Some(4)],
        [Some(15), None],
        [Some(9), Some(5)],
        [Some(0), Some(2)],
        [None, Some(15)],
        [Some(5), Some(9)],
    ];
    for (round, ks) in rounds.iter().enumerate() {
        let mut batch: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, &seq) in seqs.iter().enumerate() {
            assert_eq!(
                engine.dflash_context(seq),
                Some(engine.position(seq)),
                "round {round}, sequence {i}: the draft's context rows"
            );
            let Some(k) = ks[i] else { continue };
            let mut drafts = Vec::new();
            engine
                .dflash_drafts(seq, pending[i], k, &mut drafts)
                .expect("drafts");
            let want = refs[i].drafts(pending[i], k);
            assert_eq!(drafts, want, "round {round}, sequence {i}: drafts");
            compared += drafts.len();
            let mut tokens = vec![pending[i]];
            tokens.extend_from_slice(&drafts);
            batch.push((i, tokens));
        }
        let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); batch.len()];
        let step: Vec<(SeqId, &[u32])> = batch
            .iter()
            .map(|(i, t)| (seqs[*i], t.as_slice()))
            .collect();
        engine
            .step(&step, &mut |g, _, l| logits[g].push(l.to_vec()))
            .expect("step");
        for (g, (i, tokens)) in batch.iter().enumerate() {
            // Keep a varying number of rows: all of them, one, or some in between.
            let len = tokens.len();
            let keep = [len, 1, len.div_ceil(2), len.saturating_sub(1).max(1)][(round + i) % 4];
            engine.commit(seqs[*i], keep).expect("commit");
            refs[*i].step(tokens, keep);
            pending[*i] = argmax(&logits[g][keep - 1]);
        }
    }
    for (i, &seq) in seqs.iter().enumerate() {
        assert_eq!(
            engine.dflash_context(seq),
            Some(engine.position(seq)),
            "{i}"
        );
        assert_eq!(engine.position(seq), refs[i].model.position(), "{i}");
    }
    assert!(compared > 50, "{compared} drafts compared");
    eprintln!(
        "{compared} drafts equal the reference's; took {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// A DFlash sequence started from the prefix cache (its first rows' context copied from the
/// cached state) and one copied from another sequence (`fork`, the samples of a prompt) draft
/// exactly what a sequence reading the same prompt cold drafts.
#[test]
fn engine_drafts_from_a_cached_prefix_or_a_copy_equal_a_cold_start() {
    let Some((model, draft_path)) = model_and_draft() else {
        return;
    };
    let Loaded { codec, mut engine } = load(&model, Some(&draft_path), 512, 4);
    let dflash = |reuse_prefix| SequenceStart {
        reuse_prefix,
        dflash: true,
    };
    let text = "The quick brown fox jumps over the lazy dog, and then it runs far away.";
    let prompt = codec.prompt_tokens(text, false).expect("tokens");
    // A finished DFlash sequence: its state and context rows go to the prefix cache.
    let (a, reused) = engine.start_sequence(&prompt, dflash(true)).expect("a");
    assert_eq!(reused, 0);
    let first = prefill_all(&mut *engine, &[(a, &prompt)])[0];
    engine.release(a);
    // The same prompt with a different ending: from the cache, then cold.
    let mut longer = prompt[..prompt.len() - 3].to_vec();
    longer.extend(codec.prompt_tokens(" and sleeps.", false).expect("tokens"));
    let (warm, reused) = engine.start_sequence(&longer, dflash(true)).expect("warm");
    assert_eq!(reused, prompt.len() - 3, "the cached prefix");
    assert_eq!(engine.dflash_context(warm), Some(reused));
    let (cold, reused) = engine.start_sequence(&longer, dflash(false)).expect("cold");
    assert_eq!(reused, 0);
    let next = prefill_all(
        &mut *engine,
        &[(warm, &longer[prompt.len() - 3..]), (cold, &longer)],
    );
    assert_eq!(next[0], next[1]);
    let drafts = |engine: &mut Box<dyn Engine + Send>, seq| {
        let mut d = Vec::new();
        engine
            .dflash_drafts(seq, next[0], 15, &mut d)
            .expect("drafts");
        d
    };
    let want = drafts(&mut engine, cold);
    assert_eq!(want.len(), 15);
    assert_eq!(drafts(&mut engine, warm), want, "from the prefix cache");
    // A copy of the cold sequence (how the samples of one prompt start).
    let (copy, _) = engine.start_sequence(&longer, dflash(false)).expect("copy");
    engine.fork(cold, copy).expect("fork");
    assert_eq!(engine.dflash_context(copy), Some(longer.len()));
    assert_eq!(drafts(&mut engine, copy), want, "a copy");
    // A plain sequence's state holds no context rows: it does not start a DFlash one.
    let plain_start = SequenceStart {
        reuse_prefix: true,
        dflash: false,
    };
    let (p, _) = engine
        .start_sequence(&[first, 1, 2, 3, 4], plain_start)
        .expect("plain");
    prefill_all(&mut *engine, &[(p, &[first, 1, 2, 3, 4])]);
    engine.release(p);
    let (d, reused) = engine
        .start_sequence(&[first, 1, 2, 3, 4, 5], dflash(true))
        .expect("dflash");
    assert_eq!(reused, 0, "a DFlash start from a plain state");
    let (q, reused) = engine
        .start_sequence(&[first, 1, 2, 3, 4, 5], plain_start)
        .expect("plain again");
    assert_eq!(reused, 5, "a plain start from it");
    for s in [warm, cold, copy, d, q] {
        engine.release(s);
    }
}

/// The binary: `--draft` refuses what is not a DFlash draft for the model, by name and reason;
/// `--speculate dflash` without `--draft` is refused; a server without a draft answers a DFlash
/// request with a 400 naming `speculative`.
#[test]
fn the_binary_refuses_drafts_that_do_not_fit() {
    let Some((model, draft)) = model_and_draft() else {
        return;
    };
    let Some(gguf_py) = gguf_py() else { return };
    let narrow = random_draft(
        &model,
        "narrow",
        &[
            "--hidden",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--ffn",
            "512",
        ],
    )
    .expect("narrow draft");
    let retoken = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/retoken_gguf.py");
    let (retokened, tmp) = kept_file(
        &format!("retokened {}", draft.display()),
        &[Path::new(retoken), &draft],
    );
    if !retokened.is_file() {
        let run = Command::new("python3")
            .arg(retoken)
            .arg(&draft)
            .arg(&tmp)
            .args(["300", "301"])
            .env("PYTHONPATH", &gguf_py)
            .output()
            .expect("python3");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        std::fs::rename(&tmp, &retokened).expect("rename into place");
    }
    let refused = |args: &[&std::ffi::OsStr], want: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_forward-serve"))
            .args(["--backend", "host", "--port", "0", "--model"])
            .arg(&model)
            .args(args)
            .output()
            .expect("run forward-serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        for w in want {
            assert!(err.contains(w), "{args:?}: no {w:?} in {err}");
        }
    };
    refused(
        &["--draft".as_ref(), model.as_os_str()],
        &["--draft", "is not a DFlash draft"],
    );
    refused(
        &["--draft".as_ref(), narrow.as_os_str()],
        &["--draft", "256 wide, the target 576"],
    );
    refused(
        &["--draft".as_ref(), retokened.as_os_str()],
        &["--draft", "another tokenizer", "token 300"],
    );
    refused(
        &["--speculate".as_ref(), "dflash".as_ref()],
        &["--speculate dflash needs a DFlash draft"],
    );
    // No draft: the request is refused, naming the field.
    let (mut child, base) = spawn_binary(
        &[
            "--model".as_ref(),
            model.as_os_str(),
            "--backend".as_ref(),
            "host".as_ref(),
        ],
        Duration::from_secs(120),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let r = rt.block_on(post_json(
        addr_of(&base),
        "/v1/completions",
        &json!({"prompt": "Hi", "speculative": {"drafter": "dflash"}}),
    ));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.status, 400, "{}", r.text());
    let e = err_of(&r);
    assert_eq!(e["param"], "speculative");
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("--draft")),
        "{e}"
    );
}

/// The official OpenAI Python client against the binary started with `--draft`: the request
/// field travels in `extra_body`, greedy completions and chats drafting with DFlash equal the
/// plain ones, an unknown drafter is a `BadRequestError`, and /metrics counts the DFlash rounds.
#[test]
fn openai_client_asks_for_dflash_drafts() {
    let Some((model, draft)) = model_and_draft() else {
        return;
    };
    let have = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with the `openai` package is missing under CI (.ci/run installs it)"
        );
        eprintln!("SKIPPED: python3 with the `openai` package is not available (python3 -m pip install openai)");
        return;
    }
    let id = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .expect("model name");
    let (mut child, base) = spawn_binary(
        &[
            "--model".as_ref(),
            model.as_os_str(),
            "--backend".as_ref(),
            "host".as_ref(),
            "--ctx".as_ref(),
            "512".as_ref(),
            "--draft".as_ref(),
            draft.as_os_str(),
        ],
        Duration::from_secs(120),
    );
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/dflash_client.py"
        ))
        .arg(format!("{base}/v1"))
        .arg(&id)
        .output();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let metrics = rt.block_on(get(addr_of(&base), "/metrics")).text();
    let _ = child.kill();
    let _ = child.wait();
    let out = out.expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dflash_client.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for check in ["completion ok", "chat ok", "stream ok", "bad drafter ok"] {
        assert!(stdout.contains(check), "missing {check:?} in:\n{stdout}");
    }
    assert!(
        drafter_metric(&metrics, "rounds_total", "dflash") > 0.0,
        "{metrics}"
    );
    assert_eq!(drafter_metric(&metrics, "errors_total", "dflash"), 0.0);
}

/// `--draft default`: the draft trained for the default model and shipped with xdna, per request
/// with `"speculative": {"type": "dflash"}`: each greedy answer equals the same request decoded
/// plainly, and /metrics shows more than one token per DFlash round.
#[test]
fn the_shipped_draft_serves_requests_that_ask_for_it() {
    let Some(model) = smollm2::smollm2_gguf() else {
        return;
    };
    let (mut child, base) = spawn_binary(
        &[
            "--model".as_ref(),
            model.as_os_str(),
            "--backend".as_ref(),
            "host".as_ref(),
            "--ctx".as_ref(),
            "512".as_ref(),
            "--draft".as_ref(),
            "default".as_ref(),
        ],
        Duration::from_secs(120),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let addr = addr_of(&base);
    let prompts = [
        "The bridge over the river was built in",
        "def area(width, height):\n    \"\"\"Return the area of a rectangle.\"\"\"\n",
    ];
    let metrics = rt.block_on(async {
        for p in prompts {
            let plain = greedy(addr, p, 64, json!(false)).await;
            let drafted = greedy(addr, p, 64, json!({"type": "dflash"})).await;
            assert_eq!(drafted, plain, "{p:?}");
        }
        get(addr, "/metrics").await.text()
    });
    let _ = child.kill();
    let _ = child.wait();
    let rounds = drafter_metric(&metrics, "rounds_total", "dflash");
    let tau = drafter_metric(&metrics, "tau", "dflash");
    eprintln!("shipped draft through forward-serve: {rounds} rounds, {tau:.2} tokens per round");
    assert!(rounds > 0.0, "{metrics}");
    assert!(
        tau > 1.1,
        "the shipped draft is accepted too rarely: {tau:.2}"
    );
    assert_eq!(drafter_metric(&metrics, "errors_total", "dflash"), 0.0);
}
