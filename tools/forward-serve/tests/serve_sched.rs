//! The engine thread's turn structure, observed through a recording wrapper around the fake
//! engine: prompts are fed in chunks of ≤ 128 tokens, one chunk per turn, with a decode pass of the
//! running streams between chunks (a long prompt does not starve them); all generating sequences
//! share one pass; states are released when requests end.

use forward_serve::engine::{Engine, EngineError, PrefillItem, SamplingConfig, SeqId};
use forward_serve::fake::{expected_text, FakeCodec, FakeEngine};
use forward_serve::metrics::Metrics;
use forward_serve::scheduler::{self, Control, Event, GenRequest};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

#[derive(Clone, Debug, PartialEq)]
enum Op {
    Prefill { seq: SeqId, tokens: usize },
    Step { seqs: Vec<SeqId>, rows: usize },
    Release(SeqId),
}

struct Recording {
    inner: FakeEngine,
    log: Arc<Mutex<Vec<Op>>>,
}

impl Engine for Recording {
    fn max_sequences(&self) -> usize {
        self.inner.max_sequences()
    }
    fn new_sequence(&mut self) -> Result<SeqId, EngineError> {
        self.inner.new_sequence()
    }
    fn prefill(
        &mut self,
        item: &PrefillItem<'_>,
        sink: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), EngineError> {
        self.log.lock().unwrap().push(Op::Prefill {
            seq: item.seq,
            tokens: item.tokens.len(),
        });
        self.inner.prefill(item, sink)
    }
    fn step(
        &mut self,
        batch: &[(SeqId, &[u32])],
        sink: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<(), EngineError> {
        self.log.lock().unwrap().push(Op::Step {
            seqs: batch.iter().map(|(s, _)| *s).collect(),
            rows: batch.iter().map(|(_, t)| t.len()).sum(),
        });
        self.inner.step(batch, sink)
    }
    fn commit(&mut self, seq: SeqId, n: usize) -> Result<(), EngineError> {
        self.inner.commit(seq, n)
    }
    fn position(&self, seq: SeqId) -> usize {
        self.inner.position(seq)
    }
    fn release(&mut self, seq: SeqId) {
        self.log.lock().unwrap().push(Op::Release(seq));
        self.inner.release(seq)
    }
}

fn request(prompt: &str, max_tokens: usize) -> (GenRequest, mpsc::UnboundedReceiver<Event>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        GenRequest {
            prompt: prompt.bytes().map(u32::from).collect(),
            max_tokens,
            sampling: SamplingConfig {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
            },
            seed: 0,
            stop: Vec::new(),
            deadline: Instant::now() + Duration::from_secs(60),
            cancel: Arc::new(AtomicBool::new(false)),
            events: tx,
            speculate: None,
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: false,
            adjust: Default::default(),
            group: None,
        },
        rx,
    )
}

fn text_of(rx: &mut mpsc::UnboundedReceiver<Event>) -> String {
    let mut s = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Text(t) => s.push_str(&t),
            Event::Done { .. } => return s,
            Event::Logprobs(_) | Event::PromptLogprobs(_) => {}
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
    panic!("no Done")
}

#[test]
fn long_prompt_is_chunked_and_interleaved_with_decode_turns() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let engine = Recording {
        inner: FakeEngine::new(16, Duration::ZERO),
        log: log.clone(),
    };
    let metrics = Arc::new(Metrics::default());
    let (qtx, qrx) = mpsc::channel(16);
    // Queue everything before the engine thread starts, so the first admission sees all three.
    let short_a = "abc";
    let short_b = "hello";
    let long: String = (0..1000).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let (ra, mut rxa) = request(short_a, 40);
    let (rb, mut rxb) = request(short_b, 40);
    let (rl, mut rxl) = request(&long, 5);
    for r in [ra, rb, rl] {
        metrics
            .queue_depth
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        qtx.try_send(r).unwrap();
    }
    drop(qtx);
    let h = scheduler::spawn(
        Box::new(engine),
        Arc::new(FakeCodec::new(2048)),
        qrx,
        16,
        metrics,
        Arc::new(Control::default()),
    )
    .unwrap();
    assert_eq!(text_of(&mut rxa), expected_text(short_a, 40).0);
    assert_eq!(text_of(&mut rxb), expected_text(short_b, 40).0);
    assert_eq!(text_of(&mut rxl), expected_text(&long, 5).0);
    assert!(scheduler::join_within(h, Duration::from_secs(10)));
    let log = log.lock().unwrap().clone();
    // Sequence ids in admission order: 1 = a, 2 = b, 3 = the long prompt.
    let chunks: Vec<usize> = log
        .iter()
        .filter_map(|op| match op {
            Op::Prefill { seq: 3, tokens } => Some(*tokens),
            _ => None,
        })
        .collect();
    // a (3 tokens) and b (5) start in the first turn with the long prompt's first 120 tokens; then
    // one 128-token chunk per turn.
    assert_eq!(
        chunks,
        vec![120, 128, 128, 128, 128, 128, 128, 112],
        "{log:?}"
    );
    assert_eq!(
        &log[..3],
        &[
            Op::Prefill { seq: 1, tokens: 3 },
            Op::Prefill { seq: 2, tokens: 5 },
            Op::Prefill {
                seq: 3,
                tokens: 120
            },
        ],
        "{log:?}"
    );
    // Between two chunks of the long prompt there is exactly one decode pass, and it carries both
    // running streams in one batched step.
    let at: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op, Op::Prefill { seq: 3, .. }))
        .map(|(i, _)| i)
        .collect();
    for w in at.windows(2) {
        let between = &log[w[0] + 1..w[1]];
        assert_eq!(
            between,
            &[Op::Step {
                seqs: vec![1, 2],
                rows: 2
            }],
            "{log:?}"
        );
    }
    // Never more than 128 prompt tokens between two decode passes.
    let mut since_step = 0;
    for op in &log {
        match op {
            Op::Prefill { tokens, .. } => {
                since_step += tokens;
                assert!(since_step <= 128, "{log:?}");
            }
            Op::Step { .. } => since_step = 0,
            Op::Release(_) => {}
        }
    }
    // Once the long prompt is read, all three share passes; every sequence is released.
    assert!(log.contains(&Op::Step {
        seqs: vec![1, 2, 3],
        rows: 3
    }));
    for id in 1..=3 {
        assert_eq!(
            log.iter().filter(|op| **op == Op::Release(id)).count(),
            1,
            "{log:?}"
        );
    }
    // No pass ever exceeds 16 rows; no prefill call exceeds one chunk.
    for op in &log {
        match op {
            Op::Step { rows, .. } => assert!(*rows <= 16),
            Op::Prefill { tokens, .. } => assert!(*tokens <= 128),
            Op::Release(_) => {}
        }
    }
}
