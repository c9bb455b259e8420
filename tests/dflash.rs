//! DFlash block drafting on the default model: the fast draft forward against the f64
//! reference, the context cache's growth, the drafter in the speculative loop (output equal to
//! plain greedy decoding) and what a draft file may not hold.
//!
//! The draft is a random-weight generation-1 DFlash GGUF written by llama.cpp's own writer
//! (`tools/llama-cpp/random_gguf.py --arch dflash`, gguf-py beside the llama.cpp programs of
//! `XDNA_LLAMA_CPP_BIN`) with the keys llama.cpp's converter writes. Without llama.cpp or the
//! default model the tests skip loudly; under CI they fail.

#[path = "support/scratch_dir.rs"]
mod scratch_dir;
#[path = "support/smollm2.rs"]
mod smollm2;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use xdna::model::dflash::{reference_block_logits, DflashDraft, DflashWeights};
use xdna::model::load::{open_model, open_package, Backend, LoadOptions};
use xdna::model::sampling::SamplingConfig;
use xdna::model::Model;
use xdna::spec::{DflashDrafter, SpecConfig, SpecRunner, StopConditions};
use xdna::weights::Package;

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

/// A random DFlash draft for the default model (hidden 576, 9/3 heads of 64, 1536 MLP), written
/// by `random_gguf.py --arch dflash EXTRA`.
fn random_draft(target: &Path, name: &str, extra: &[&str]) -> Option<PathBuf> {
    let gguf_py = gguf_py()?;
    let out = scratch_dir::scratch_path("dflash", &format!("{name}.gguf"));
    let run = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tools/llama-cpp/random_gguf.py"
        ))
        .args([
            "--arch",
            "dflash",
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
            "--rope-base",
            "100000",
            "--rms-eps",
            "1e-5",
        ])
        .args(extra)
        .arg("--tokenizer-from")
        .arg(target)
        .arg("--out")
        .arg(&out)
        .env("PYTHONPATH", &gguf_py)
        .output()
        .expect("run python3");
    assert!(
        run.status.success(),
        "random_gguf.py --arch dflash failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    Some(out)
}

struct Setup {
    target_pkg: Arc<Package>,
    target: Model,
    draft_pkg: Arc<Package>,
    draft: Arc<DflashWeights>,
    prompt: Vec<u32>,
}

fn setup(name: &str, extra: &[&str]) -> Option<Setup> {
    setup_with(name, extra, false)
}

/// `exact`: both models without activation rounding ([`LoadOptions::exact`]).
fn setup_with(name: &str, extra: &[&str], exact: bool) -> Option<Setup> {
    let gguf = smollm2::smollm2_gguf()?;
    let draft_path = random_draft(&gguf, name, extra)?;
    let opts = LoadOptions {
        backend: Backend::Host,
        kernels: None,
        exact,
    };
    let (target_pkg, target) = open_model(Some(&gguf), 512, &opts).expect("target loads");
    let draft_pkg = open_package(&draft_path).expect("draft opens");
    let draft = Arc::new(DflashWeights::load(&draft_pkg, exact).expect("draft loads"));
    let prompt = target_pkg.encode_prompt(
        "The quick brown fox jumps over the lazy dog, and then it runs far away.",
        false,
    );
    Some(Setup {
        target_pkg,
        target,
        draft_pkg,
        draft,
        prompt,
    })
}

/// The target's hidden states at the draft's taps for `tokens`, one context row each
/// (`[rows, taps · hidden]`), through the model's tapped prefill.
fn context_features(target: &mut Model, taps: &[usize], tokens: &[u32]) -> Vec<f32> {
    let hidden = target.config().hidden;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    target
        .prefill_tapped(tokens, taps, &mut |out| {
            for r in 0..out.rows() {
                let mut row = Vec::with_capacity(taps.len() * hidden);
                for t in 0..taps.len() {
                    row.extend_from_slice(out.tap(t, r));
                }
                rows.push(row);
            }
        })
        .expect("tapped prefill");
    rows.concat()
}

#[test]
fn fast_draft_forward_matches_the_f64_reference() {
    fast_forward_against_reference("reference", &[]);
}

#[test]
fn fast_draft_forward_matches_the_f64_reference_generation_2() {
    fast_forward_against_reference("reference2", &["--dflash-generation", "2"]);
}

fn fast_forward_against_reference(name: &str, extra: &[&str]) {
    let Some(mut s) = setup_with(name, extra, true) else {
        return;
    };
    let taps = s.draft.params().target_layers.clone();
    assert_eq!(
        taps,
        vec![1, 10, 19, 28],
        "GGUF hidden-state indices are layer ids + 1"
    );
    let context = &s.prompt[..s.prompt.len() - 1];
    let pending = *s.prompt.last().expect("prompt");
    let features = context_features(&mut s.target, &taps, context);
    let mut draft = DflashDraft::new(s.draft.clone(), s.target.weights_arc()).expect("draft binds");
    draft
        .push_context(&features, context.len())
        .expect("context rows");
    let fast = draft.block_logits(pending).expect("block").to_vec();
    let exact =
        reference_block_logits(&s.draft_pkg, &s.target_pkg, &features, pending).expect("reference");
    assert_eq!(fast.len(), exact.len());
    let vocab = s.target.config().vocab;
    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = fast
        .iter()
        .zip(&exact)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("block logits: max |fast − f64 reference| = {worst:.2e} (scale {scale:.2})");
    assert!(worst < 2e-3 * scale, "fast path {worst} off the reference");
    for (r, (f, e)) in fast.chunks(vocab).zip(exact.chunks(vocab)).enumerate() {
        let top = |row: &[f32]| {
            let mut idx: Vec<usize> = (0..row.len()).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            (idx[0], row[idx[0]] - row[idx[1]])
        };
        let ((tf, _), (te, margin)) = (top(f), top(e));
        if margin > 1e-2 {
            assert_eq!(
                tf, te,
                "row {r}: draft {tf}, reference {te} (margin {margin})"
            );
        }
    }
}

#[test]
fn context_grown_in_pieces_equals_one_push() {
    let Some(mut s) = setup("pieces", &[]) else {
        return;
    };
    let taps = s.draft.params().target_layers.clone();
    let context = &s.prompt[..5];
    let features = context_features(&mut s.target, &taps, context);
    let width = features.len() / 5;
    let mut whole = DflashDraft::new(s.draft.clone(), s.target.weights_arc()).expect("binds");
    whole.push_context(&features, 5).expect("push 5");
    let mut pieces = DflashDraft::new(s.draft.clone(), s.target.weights_arc()).expect("binds");
    for (from, to) in [(0, 2), (2, 3), (3, 5)] {
        pieces
            .push_context(&features[from * width..to * width], to - from)
            .expect("push");
    }
    assert_eq!(pieces.context(), 5);
    let a = whole.block_logits(s.prompt[5]).expect("block").to_vec();
    let b = pieces.block_logits(s.prompt[5]).expect("block").to_vec();
    assert_eq!(a, b, "2 + 1 + 2 context rows differ from 5 at once");
    // A block leaves the context as it was: the same block again gives the same logits.
    let again = pieces.block_logits(s.prompt[5]).expect("block").to_vec();
    assert_eq!(b, again);
}

#[test]
fn speculative_run_with_a_dflash_draft_equals_plain_greedy() {
    let Some(mut s) = setup("loop", &[]) else {
        return;
    };
    const TOKENS: usize = 40;
    // Plain greedy decoding.
    s.target.reset();
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(0, |b, (i, &v)| if v > row[b] { i } else { b }) as u32
    };
    let mut next = argmax(s.target.prefill(&s.prompt).expect("prefill"));
    let mut plain = vec![next];
    while plain.len() < TOKENS {
        next = argmax(s.target.step(next).expect("step"));
        plain.push(next);
    }
    // The same through the speculative loop with the DFlash drafter.
    s.target.reset();
    let draft = DflashDraft::new(s.draft.clone(), s.target.weights_arc()).expect("binds");
    let config = SpecConfig {
        sampling: SamplingConfig::GREEDY,
        max_drafts: 15,
        min_drafts: 1,
        initial_drafts: 15,
        adaptive_drafts: false,
        fallback: xdna::spec::FallbackConfig {
            enabled: false,
            ..Default::default()
        },
        seed: 0,
    };
    let mut runner = SpecRunner::new(config, DflashDrafter::new(draft)).expect("runner");
    runner
        .prefill(&mut s.target, &s.prompt[..s.prompt.len() - 1])
        .expect("prefill with taps");
    let generation = runner
        .generate(
            &mut s.target,
            &s.prompt,
            &StopConditions::max_tokens(TOKENS),
        )
        .expect("speculative generation");
    assert_eq!(
        generation.tokens, plain,
        "speculative output differs from greedy"
    );
    let stats = runner.stats();
    eprintln!("{stats}");
    // Full blocks of 15 drafts, fewer only where fewer tokens remained.
    assert!(stats.rounds > 0 && stats.drafted > 10 * stats.rounds);
    // The drafter kept one context row per committed target position.
    assert_eq!(
        runner.drafter().draft().context(),
        s.target.position(),
        "context rows out of step with the target"
    );
}

#[test]
fn a_dflash_draft_is_refused_as_a_model_and_a_bad_mask_token_by_key() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let Some(draft) = random_draft(&gguf, "alone", &[]) else {
        return;
    };
    let opts = LoadOptions {
        backend: Backend::Host,
        kernels: None,
        exact: false,
    };
    let err = open_model(Some(&draft), 64, &opts)
        .err()
        .expect("a draft is not a model")
        .to_string();
    assert!(
        err.contains("DFlash draft") && err.contains("--speculate dflash:"),
        "{err}"
    );
    let Some(bad) = random_draft(&gguf, "mask", &["--mask-token", "99999"]) else {
        return;
    };
    let err = open_package(&bad)
        .expect_err("mask outside the vocabulary")
        .to_string();
    assert!(err.contains("tokenizer.ggml.mask_token_id"), "{err}");
}

/// One round of llama.cpp's DFlash loop as `tools/llama-cpp/dflash_reference.py` records it.
struct LlamaRound {
    pos0: usize,
    id_last: u32,
    drafted: Vec<u32>,
    top2_margin: Vec<f64>,
    emitted: Vec<u32>,
}

fn llama_rounds(json: &serde_json::Value) -> Vec<LlamaRound> {
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    json["rounds"]
        .as_array()
        .expect("rounds")
        .iter()
        .map(|r| LlamaRound {
            pos0: r["pos0"].as_u64().expect("pos0") as usize,
            id_last: r["id_last"].as_u64().expect("id_last") as u32,
            drafted: ids(&r["drafted"]),
            // A null margin: llama.cpp printed the runner-up's probability as 0.
            top2_margin: r["top2_margin"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|x| x.as_f64().unwrap_or(f64::INFINITY))
                        .collect()
                })
                .unwrap_or_default(),
            emitted: ids(&r["emitted"]),
        })
        .collect()
}

/// xdna's walk over one of llama.cpp's rounds.
struct RoundWalk {
    /// Each draft given llama.cpp's previous pick, and its margin (`block_drafts_given`).
    given: Vec<u32>,
    margins: Vec<f32>,
    /// The walk on its own, each pick after its own previous one.
    walk: Vec<u32>,
}

/// xdna's drafts for llama.cpp's rounds: the same prompt, each round's pending token and the
/// target rows llama.cpp committed, through the target's tapped passes and the DFlash drafter.
fn walk_llama_rounds(
    target: &mut Model,
    draft: Arc<DflashWeights>,
    prompt: &[u32],
    rounds: &[LlamaRound],
) -> Vec<RoundWalk> {
    use xdna::spec::{AcceptanceRule, DraftProposal, Drafter, TapRows, VerifyTarget};
    target.reset();
    let mut drafter =
        DflashDrafter::new(DflashDraft::new(draft, target.weights_arc()).expect("draft binds"));
    let taps = drafter.target_taps().to_vec();
    assert!(target.request_taps(&taps));
    let hidden = target.config().hidden;
    let context = &prompt[..prompt.len() - 1];
    let mut sequence = prompt.to_vec();
    let mut failure = None;
    VerifyTarget::prefill_tapped(target, context, &mut |rows: TapRows<'_>| {
        if failure.is_none() {
            failure = drafter.observe_target_rows(rows).err();
        }
    })
    .expect("prefill");
    assert!(failure.is_none(), "{failure:?}");
    let mut proposal = DraftProposal::new();
    let mut walks = Vec::with_capacity(rounds.len());
    for (r, round) in rounds.iter().enumerate() {
        assert_eq!(
            round.pos0,
            target.position(),
            "round {r}: llama.cpp's position"
        );
        assert_eq!(
            Some(&round.id_last),
            sequence.last(),
            "round {r}: pending token"
        );
        drafter
            .propose(&sequence, 15, &AcceptanceRule::Greedy, &mut proposal)
            .expect("propose");
        // Each draft given llama.cpp's previous pick (generation 2's walk is a chain: one
        // flipped near-tie would otherwise change every later pick of the block), with its
        // margin; generation 1 ignores the given picks.
        let (mut given, mut margins) = (Vec::new(), Vec::new());
        drafter
            .draft_mut()
            .block_drafts_given(
                round.id_last,
                Some(&round.drafted),
                &mut given,
                &mut margins,
            )
            .expect("block");
        if !round.top2_margin.is_empty() {
            assert_eq!(
                &given[..],
                proposal.tokens(),
                "round {r}: generation 1 walks alike"
            );
        }
        walks.push(RoundWalk {
            given,
            margins,
            walk: proposal.tokens().to_vec(),
        });
        // Commit what llama.cpp committed: the pending token and the accepted drafts.
        let accepted = round.emitted.len() - 1;
        let mut rows = vec![round.id_last];
        rows.extend_from_slice(&round.drafted[..accepted]);
        VerifyTarget::step_batch_all(target, &rows).expect("pass");
        VerifyTarget::commit_verify_rows(target, rows.len()).expect("commit");
        let tapped = target.pass_taps().expect("taps");
        assert_eq!(tapped.hidden(), hidden);
        drafter.observe_target_rows(tapped).expect("context rows");
        sequence.extend_from_slice(&round.emitted);
    }
    walks
}

/// How settled each of a round's drafts is: llama.cpp's top-2 margin where it logs one
/// (generation 1), else xdna's margin; where `exact` (the same walk with nothing rounded) is
/// given, the smaller of its margin and the fast walk's, and 0 where the two pick differently
/// (the target's rounding alone decides such a draft).
fn draft_margins(round: &LlamaRound, fast: &RoundWalk, exact: Option<&RoundWalk>) -> Vec<f64> {
    (0..fast.given.len())
        .map(|i| {
            if let Some(&m) = round.top2_margin.get(i) {
                return m;
            }
            let m = f64::from(fast.margins[i]);
            match exact {
                Some(e) if e.given[i] != fast.given[i] => 0.0,
                Some(e) => m.min(f64::from(e.margins[i])),
                None => m,
            }
        })
        .collect()
}

/// (drafts whose margin exceeds `min_margin`, the ones equal to llama.cpp's); with
/// `check_prefix`, each walk on its own equals llama.cpp's up to its first draft within
/// `min_margin` of a tie (when that margin is one no decided draft differs at).
fn tally_against_llama(
    rounds: &[LlamaRound],
    fast: &[RoundWalk],
    exact: Option<&[RoundWalk]>,
    min_margin: f64,
    check_prefix: bool,
) -> (usize, usize) {
    let (mut compared, mut equal) = (0, 0);
    for (r, (round, walk)) in rounds.iter().zip(fast).enumerate() {
        let margins = draft_margins(round, walk, exact.map(|e| &e[r]));
        let settled = margins
            .iter()
            .position(|&m| m <= min_margin)
            .unwrap_or(margins.len());
        if check_prefix {
            assert_eq!(
                &walk.walk[..settled],
                &round.drafted[..settled],
                "round {r}: the drafts before the first near-tie differ"
            );
        }
        for (i, ((&ours, &theirs), &margin)) in walk
            .given
            .iter()
            .zip(&round.drafted)
            .zip(&margins)
            .enumerate()
        {
            if margin > min_margin {
                compared += 1;
                if ours == theirs {
                    equal += 1;
                } else {
                    eprintln!(
                        "round {r} draft {i}: xdna {ours}, llama.cpp {theirs} (margin {margin:.3})"
                    );
                }
            }
        }
    }
    (compared, equal)
}

/// Prints how far the target's rounding alone moves the walk: picks that part between the
/// rounded walk `fast` and the `exact` one (and the largest rounded margin among them), the
/// margin shift where they agree, and each draft past `min_margin` in the rounded walk that
/// llama.cpp picks otherwise than both walks, with its margin in the exact walk.
fn print_rounding_spread(
    rounds: &[LlamaRound],
    fast: &[RoundWalk],
    exact: &[RoundWalk],
    min_margin: f64,
) {
    let (mut parted, mut drafts, mut parted_margin) = (0, 0, 0f32);
    let mut shifts = Vec::new();
    for (r, (round, (f, e))) in rounds.iter().zip(fast.iter().zip(exact)).enumerate() {
        for (i, &theirs) in round.drafted.iter().enumerate().take(f.given.len()) {
            drafts += 1;
            if f.given[i] == e.given[i] {
                shifts.push((f.margins[i] - e.margins[i]).abs());
            } else {
                parted += 1;
                parted_margin = parted_margin.max(f.margins[i]);
            }
            let past = f64::from(f.margins[i]) > min_margin;
            if past && theirs != f.given[i] && theirs != e.given[i] {
                eprintln!(
                    "round {r} draft {i}: llama.cpp {theirs}, rounded walk {} (margin {:.3}), exact walk {} (margin {:.3})",
                    f.given[i], f.margins[i], e.given[i], e.margins[i]
                );
            }
        }
    }
    shifts.sort_by(f32::total_cmp);
    if let (Some(median), Some(max)) = (shifts.get(shifts.len() / 2), shifts.last()) {
        eprintln!(
            "the target's rounding alone: {parted} of {drafts} picks part between xdna's rounded and exact walks (rounded margins up to {parted_margin:.3}); where they agree the margin shifts by {median:.3} nat (median), {max:.3} at most"
        );
    }
}

#[test]
fn drafts_equal_llama_cpps_on_its_own_rounds() {
    let Some(c) = llama_cpp_comparison(&[], 0.5) else {
        return;
    };
    assert!(
        c.equal * 100 >= c.compared * 95,
        "only {} of {} drafts equal",
        c.equal,
        c.compared
    );
    assert_eq!(c.decided_equal, c.decided);
}

/// Generation 2 drafts through the selector's walk, compared pick by pick after llama.cpp's own
/// previous pick. llama.cpp logs no margins for them: xdna's tell near-ties, the selector's score
/// margin or the gap at the edge of the top-k candidate set, whichever is smaller (a token just
/// outside the set in one runtime and inside in the other can win by its pairwise term; with
/// random weights the top logits are dense, so this gap is often small). Decided drafts are
/// past 0.3 nat both in xdna's walk and in its walk without rounding, with the same pick: the
/// target's rounding alone moves these margins by about as much, and parts the two walks at
/// margins up to half a nat (the run prints both, and each draft past 0.3 nat of the rounded walk
/// that llama.cpp picks otherwise than both walks, with its exact margin).
#[test]
fn generation_2_drafts_equal_llama_cpps_on_its_own_rounds() {
    let Some(c) = llama_cpp_comparison(&["--dflash-generation", "2"], 0.3) else {
        return;
    };
    assert!(
        c.equal * 100 >= c.compared * 90,
        "only {} of {} drafts equal",
        c.equal,
        c.compared
    );
    assert!(
        c.decided >= 10,
        "only {} decided drafts to compare",
        c.decided
    );
    assert_eq!(c.decided_equal, c.decided);
}

/// A random draft (`random_gguf.py --arch dflash EXTRA`) run by llama.cpp's
/// `llama-speculative-simple --spec-type draft-dflash` (tools/llama-cpp/dflash_reference.py),
/// and xdna's drafts on llama.cpp's rounds: (drafts with a margin > 0.1 nat, equal ones, drafts
/// with a margin > `decided_margin`, equal ones). The margin is llama.cpp's where it logs one
/// (generation 1), else xdna's ([`draft_margins`]: for decided drafts, with its walk without
/// rounding).
fn llama_cpp_comparison(extra: &[&str], decided_margin: f64) -> Option<LlamaComparison> {
    let gguf = smollm2::smollm2_gguf()?;
    gguf_py()?;
    let name = format!("llama-cpp{}", extra.join(""));
    let draft_path = random_draft(&gguf, &name, extra)?;
    let c = compare_draft_with_llama_cpp(
        &draft_path,
        "The old lighthouse keeper climbed the stairs every evening, counting the steps",
        24,
        15,
        decided_margin,
    )?;
    Some(c)
}

/// How xdna's drafts compare with llama.cpp's on llama.cpp's own rounds.
struct LlamaComparison {
    /// Drafts with a margin > 0.1 nat, and the equal ones.
    compared: usize,
    equal: usize,
    /// Drafts with a margin > the decided margin, and the equal ones.
    decided: usize,
    decided_equal: usize,
    /// llama.cpp's rounds and the tokens they emitted.
    rounds: usize,
    emitted: usize,
}

/// `draft_path` run by llama.cpp's `llama-speculative-simple --spec-type draft-dflash` on the
/// default model (tools/llama-cpp/dflash_reference.py: temperature 0, `draft_max` drafts per
/// round, `n` tokens), and xdna's drafts on llama.cpp's rounds.
fn compare_draft_with_llama_cpp(
    draft_path: &Path,
    prompt: &str,
    n: usize,
    draft_max: usize,
    decided_margin: f64,
) -> Option<LlamaComparison> {
    let gguf = smollm2::smollm2_gguf()?;
    let gguf_py = gguf_py()?;
    let bin = gguf_py.parent().expect("bin dir").join("bin");
    assert!(
        bin.join("llama-speculative-simple").is_file(),
        "{} holds no llama-speculative-simple (tools/llama-cpp/build.sh builds it)",
        bin.display()
    );
    let json_path = scratch_dir::scratch_path(
        "dflash",
        &format!(
            "{}-rounds.json",
            draft_path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        ),
    );
    let run = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tools/llama-cpp/dflash_reference.py"
        ))
        .arg("--bin")
        .arg(&bin)
        .arg("--target")
        .arg(&gguf)
        .arg("--draft")
        .arg(draft_path)
        .args([
            "--prompt",
            prompt,
            "-n",
            &n.to_string(),
            "--draft-max",
            &draft_max.to_string(),
            "--out",
        ])
        .arg(&json_path)
        .output()
        .expect("run python3");
    assert!(
        run.status.success(),
        "dflash_reference.py failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).expect("read JSON")).expect("JSON");
    let _ = std::fs::remove_file(&json_path);
    assert_eq!(
        json["plain_greedy_equal"].as_bool(),
        Some(true),
        "llama.cpp's own speculative run differs from its greedy run"
    );
    let prompt: Vec<u32> = json["prompt_ids"]
        .as_array()
        .expect("prompt")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect();
    let rounds = llama_rounds(&json);
    // `exact`: nothing rounded (no 8-bit activations, an f32 KV cache); otherwise activations
    // rounded as llama.cpp rounds them.
    let walk = |exact: bool| {
        let opts = LoadOptions {
            backend: Backend::Host,
            kernels: None,
            exact,
        };
        let (_, mut target) = open_model(Some(&gguf), 1024, &opts).expect("target");
        let draft = Arc::new(
            DflashWeights::load(&open_package(draft_path).expect("draft"), exact).expect("draft"),
        );
        walk_llama_rounds(&mut target, draft, &prompt, &rounds)
    };
    let fast = walk(false);
    // Random weights magnify rounding: near-ties may flip, decided drafts may not. Where
    // llama.cpp logs no margins (generation 2), a draft is decided only if xdna's walk without
    // rounding picks it too, past the same margin: the target's rounding alone moves these
    // margins by up to a third of a nat (its hidden states feed the draft through the fusion
    // matrix), so a margin from one rounding says little about another runtime's.
    let exact = rounds
        .iter()
        .all(|r| r.top2_margin.is_empty())
        .then(|| walk(true));
    let (compared, equal) = tally_against_llama(&rounds, &fast, None, 0.1, false);
    eprintln!(
        "{} rounds: {equal} of {compared} drafts with llama.cpp's top-2 margin > 0.1 nat (or unlogged) equal llama.cpp's",
        rounds.len()
    );
    let (decided, decided_equal) =
        tally_against_llama(&rounds, &fast, exact.as_deref(), decided_margin, true);
    eprintln!(
        "{decided_equal} of {decided} drafts with a margin > {decided_margin} nat equal llama.cpp's"
    );
    if let Some(exact) = &exact {
        print_rounding_spread(&rounds, &fast, exact, decided_margin);
    }
    Some(LlamaComparison {
        compared,
        equal,
        decided,
        decided_equal,
        rounds: rounds.len(),
        emitted: rounds.iter().map(|r| r.emitted.len()).sum(),
    })
}

/// The draft trained for the default model (`tools/dflash-train`, shipped in `models/`): it
/// passes the gate as a GGUF and as the package it imports to; llama.cpp, running it through its
/// own DFlash loop, drafts what xdna drafts on the same rounds and accepts enough of them that a
/// round yields more than one token; xdna's speculative run with it equals plain greedy decoding.
#[test]
fn the_shipped_draft_drafts_as_llama_cpp_does_and_is_accepted() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    if gguf_py().is_none() {
        return;
    }
    let draft_path = xdna::weights::default_model::default_dflash_draft().expect("shipped draft");
    let report = xdna::weights::dflash_check::check(&draft_path);
    assert!(
        report.passed(),
        "the shipped GGUF fails the gate: {:?}",
        report.failures().map(|c| &c.name).collect::<Vec<_>>()
    );
    let pkg_dir = xdna::weights::import::cached_import(&draft_path).expect("import");
    let report = xdna::weights::dflash_check::check(&pkg_dir);
    assert!(
        report.passed(),
        "its package fails the gate: {:?}",
        report.failures().map(|c| &c.name).collect::<Vec<_>>()
    );
    let block = open_package(&pkg_dir)
        .expect("package")
        .config()
        .dflash
        .as_ref()
        .expect("a DFlash draft")
        .block_size;
    for (prompt, n) in [
        (
            "Walking home after the concert, she realised that the city had changed while she",
            48,
        ),
        (
            "def mean(values):\n    \"\"\"Return the arithmetic mean of a list.\"\"\"\n",
            48,
        ),
    ] {
        let Some(c) = compare_draft_with_llama_cpp(&draft_path, prompt, n, block - 1, 0.5) else {
            return;
        };
        let llama_tau = c.emitted as f64 / c.rounds as f64;
        eprintln!(
            "{prompt:?}: llama.cpp {:.2} tokens per round over {} rounds; {} of {} drafts equal, {} of {} decided",
            llama_tau, c.rounds, c.equal, c.compared, c.decided_equal, c.decided
        );
        assert_eq!(
            c.decided_equal, c.decided,
            "{prompt:?}: decided drafts differ"
        );
        assert!(
            c.equal * 100 >= c.compared * 95,
            "{prompt:?}: only {} of {} drafts equal",
            c.equal,
            c.compared
        );
        assert!(
            llama_tau > 1.1,
            "{prompt:?}: llama.cpp accepts the draft too rarely: {llama_tau:.2} tokens per round"
        );
    }

    // xdna's own loop with it: plain greedy output, the same drafts accepted.
    let opts = LoadOptions {
        backend: Backend::Host,
        kernels: None,
        exact: false,
    };
    let (pkg, mut target) = open_model(Some(&gguf), 512, &opts).expect("target");
    let prompt = pkg.encode_prompt("The bridge over the river was built in", false);
    const TOKENS: usize = 64;
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(0, |b, (i, &v)| if v > row[b] { i } else { b }) as u32
    };
    target.reset();
    let mut next = argmax(target.prefill(&prompt).expect("prefill"));
    let mut plain = vec![next];
    while plain.len() < TOKENS {
        next = argmax(target.step(next).expect("step"));
        plain.push(next);
    }
    target.reset();
    let weights = Arc::new(
        DflashWeights::load(&open_package(&pkg_dir).expect("pkg"), false).expect("weights"),
    );
    let draft = DflashDraft::new(weights, target.weights_arc()).expect("binds");
    let config = SpecConfig {
        sampling: SamplingConfig::GREEDY,
        max_drafts: block - 1,
        min_drafts: 1,
        initial_drafts: block - 1,
        adaptive_drafts: false,
        fallback: xdna::spec::FallbackConfig {
            enabled: false,
            ..Default::default()
        },
        seed: 0,
    };
    let mut runner = SpecRunner::new(config, DflashDrafter::new(draft)).expect("runner");
    runner
        .prefill(&mut target, &prompt[..prompt.len() - 1])
        .expect("prefill with taps");
    let generation = runner
        .generate(&mut target, &prompt, &StopConditions::max_tokens(TOKENS))
        .expect("speculative generation");
    assert_eq!(
        generation.tokens, plain,
        "speculative output differs from greedy"
    );
    let tau = runner.stats().mean_acceptance_length().unwrap_or(1.0);
    eprintln!("xdna: {tau:.2} tokens per round; {}", runner.stats());
    assert!(
        tau > 1.1,
        "xdna accepts the shipped draft too rarely: {tau:.2} tokens per round"
    );
}
