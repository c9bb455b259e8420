//! Counters and gauges, rendered in the Prometheus text format by `GET /metrics`.

use crate::scheduler::DrafterKind;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// The server's counters (monotonic) and gauges (current values), shared by the handlers and the
/// engine thread.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Prompt tokens prefilled.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated (sampled) for clients.
    pub generated_tokens: AtomicU64,
    /// Sequence rows run by decode passes.
    pub decode_rows: AtomicU64,
    /// Decode passes run (rows / passes = mean batch occupancy).
    pub decode_passes: AtomicU64,
    /// Nanoseconds the decode passes took (rows / seconds = decode tok/s).
    pub decode_nanos: AtomicU64,
    /// Gauge: requests waiting for a sequence slot.
    pub queue_depth: AtomicU64,
    /// Gauge: sequences being generated.
    pub active_sequences: AtomicU64,
    /// Failed engine passes.
    pub device_errors: AtomicU64,
    /// Generations cancelled (client gone or shutdown).
    pub cancelled: AtomicU64,
    /// Generations ended by the request timeout.
    pub timeouts: AtomicU64,
    /// Requests answered 503 because the queue was full.
    pub rejected_full: AtomicU64,
    /// Speculative rounds: decode passes where a sequence carried ≥ 1 draft (counted per
    /// sequence).
    pub spec_rounds: AtomicU64,
    /// Draft tokens verified.
    pub spec_drafted: AtomicU64,
    /// Draft tokens accepted.
    pub spec_accepted: AtomicU64,
    /// Per drafter ([`DrafterKind::index`]): speculative rounds, drafts verified, drafts accepted.
    pub spec_by_drafter: [DrafterCounters; 2],
    /// Per drafter: proposals that failed (the sequence decoded plainly that turn; a DFlash
    /// sequence for the rest of its generation).
    pub spec_errors: [AtomicU64; 2],
    /// Requests that started from a cached prompt prefix.
    pub prefix_hits: AtomicU64,
    /// Prompt tokens taken from the prefix cache instead of being read.
    pub prefix_tokens: AtomicU64,
    /// Samples of an `n` > 1 request that copied the prompt read for the first sample.
    pub shared_prompts: AtomicU64,
    /// Gauge: sequence states the engine holds (running, prefix-cached, spare).
    pub sequence_states: AtomicU64,
    /// Gauge: client connections open.
    pub open_connections: AtomicU64,
    /// Connections answered 503 and closed because `--max-connections` were open.
    pub rejected_connections: AtomicU64,
    /// Connections closed for not delivering a request's headers within `--header-timeout`
    /// (slow senders and idle keep-alive connections).
    pub header_timeouts: AtomicU64,
    /// Requests answered 408 for not delivering their body within `--body-timeout`.
    pub body_timeouts: AtomicU64,
}

/// One drafter's speculative counters.
#[derive(Default)]
pub struct DrafterCounters {
    /// Rounds: a sequence's pass carrying at least one of its drafts.
    pub rounds: AtomicU64,
    /// Drafts verified.
    pub drafted: AtomicU64,
    /// Drafts accepted.
    pub accepted: AtomicU64,
}

impl Metrics {
    /// Count one speculative round of `drafter`: `drafted` drafts verified, `accepted` kept.
    pub fn record_round(&self, drafter: DrafterKind, drafted: usize, accepted: usize) {
        self.spec_rounds.fetch_add(1, Relaxed);
        self.spec_drafted.fetch_add(drafted as u64, Relaxed);
        self.spec_accepted.fetch_add(accepted as u64, Relaxed);
        let c = &self.spec_by_drafter[drafter.index()];
        c.rounds.fetch_add(1, Relaxed);
        c.drafted.fetch_add(drafted as u64, Relaxed);
        c.accepted.fetch_add(accepted as u64, Relaxed);
    }

    /// Count one response of `endpoint` (an [`crate::api::endpoint_label`]) with `status`.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// Everything in the Prometheus text exposition format (what `GET /metrics` serves).
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP forward_serve_requests_total HTTP requests by endpoint and status."
        );
        let _ = writeln!(s, "# TYPE forward_serve_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((ep, st), n) in m.iter() {
                let _ = writeln!(
                    s,
                    "forward_serve_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
                );
            }
        }
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} counter");
            let _ = writeln!(s, "{name} {v}");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} gauge");
            let _ = writeln!(s, "{name} {v}");
        };
        counter(
            &mut s,
            "forward_serve_prompt_tokens_total",
            "Prompt tokens prefilled.",
            self.prompt_tokens.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_generated_tokens_total",
            "Tokens generated (sampled) for clients.",
            self.generated_tokens.load(Relaxed),
        );
        let rows = self.decode_rows.load(Relaxed);
        let nanos = self.decode_nanos.load(Relaxed);
        counter(
            &mut s,
            "forward_serve_decode_rows_total",
            "Sequence rows run by decode passes.",
            rows,
        );
        counter(
            &mut s,
            "forward_serve_decode_passes_total",
            "Batched decode passes (rows / passes = mean rows per pass).",
            self.decode_passes.load(Relaxed),
        );
        gauge(
            &mut s,
            "forward_serve_decode_seconds_total",
            "Seconds spent in decode passes.",
            nanos as f64 / 1e9,
        );
        let tps = if nanos == 0 {
            0.0
        } else {
            rows as f64 / (nanos as f64 / 1e9)
        };
        gauge(
            &mut s,
            "forward_serve_decode_tokens_per_second",
            "Decode throughput over the server's life (rows / decode seconds).",
            tps,
        );
        gauge(
            &mut s,
            "forward_serve_queue_depth",
            "Requests waiting for a slot.",
            self.queue_depth.load(Relaxed) as f64,
        );
        gauge(
            &mut s,
            "forward_serve_active_sequences",
            "Sequences being generated.",
            self.active_sequences.load(Relaxed) as f64,
        );
        counter(
            &mut s,
            "forward_serve_device_errors_total",
            "Failed engine passes.",
            self.device_errors.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_cancelled_total",
            "Generations cancelled (client gone or shutdown).",
            self.cancelled.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_timeouts_total",
            "Generations ended by the request timeout.",
            self.timeouts.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_rejected_queue_full_total",
            "Requests answered 503 because the queue was full.",
            self.rejected_full.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_prefix_cache_hits_total",
            "Requests that started from a cached prompt prefix.",
            self.prefix_hits.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_prefix_cache_tokens_total",
            "Prompt tokens taken from the prefix cache instead of being read.",
            self.prefix_tokens.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_shared_prompt_samples_total",
            "Samples of an n > 1 request that copied the prompt read for the first sample.",
            self.shared_prompts.load(Relaxed),
        );
        gauge(
            &mut s,
            "forward_serve_sequence_states",
            "Sequence states (KV caches) the engine holds: running, prefix-cached and spare.",
            self.sequence_states.load(Relaxed) as f64,
        );
        gauge(
            &mut s,
            "forward_serve_open_connections",
            "Client connections open.",
            self.open_connections.load(Relaxed) as f64,
        );
        counter(
            &mut s,
            "forward_serve_rejected_connections_total",
            "Connections answered 503 and closed because --max-connections were open.",
            self.rejected_connections.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_header_timeouts_total",
            "Connections closed for not sending a request's headers within --header-timeout.",
            self.header_timeouts.load(Relaxed),
        );
        counter(
            &mut s,
            "forward_serve_body_timeouts_total",
            "Requests answered 408 for not sending their body within --body-timeout.",
            self.body_timeouts.load(Relaxed),
        );
        let rounds = self.spec_rounds.load(Relaxed);
        let drafted = self.spec_drafted.load(Relaxed);
        let accepted = self.spec_accepted.load(Relaxed);
        counter(
            &mut s,
            "forward_serve_speculative_rounds_total",
            "Speculative rounds (a sequence's pass carrying at least one draft).",
            rounds,
        );
        counter(
            &mut s,
            "forward_serve_speculative_drafted_total",
            "Draft tokens verified.",
            drafted,
        );
        counter(
            &mut s,
            "forward_serve_speculative_accepted_total",
            "Draft tokens accepted.",
            accepted,
        );
        // τ as the spec layer reports it: 1 + accepted / rounds (the bonus/correction token counts).
        let tau = if rounds == 0 {
            0.0
        } else {
            1.0 + accepted as f64 / rounds as f64
        };
        gauge(
            &mut s,
            "forward_serve_speculative_tau",
            "Mean tokens per speculative round, 1 + accepted/rounds (0 before the first round).",
            tau,
        );
        // The same per drafter, one series per drafter from the start.
        let labelled =
            |s: &mut String, kind: &str, name: &str, help: &str, v: &dyn Fn(usize) -> String| {
                let _ = writeln!(s, "# HELP {name} {help}");
                let _ = writeln!(s, "# TYPE {name} {kind}");
                for d in DrafterKind::ALL {
                    let _ = writeln!(s, "{name}{{drafter=\"{}\"}} {}", d.name(), v(d.index()));
                }
            };
        let by = &self.spec_by_drafter;
        labelled(
            &mut s,
            "counter",
            "forward_serve_speculative_drafter_rounds_total",
            "Speculative rounds by drafter (a sequence's pass carrying at least one draft).",
            &|i| by[i].rounds.load(Relaxed).to_string(),
        );
        labelled(
            &mut s,
            "counter",
            "forward_serve_speculative_drafter_drafted_total",
            "Draft tokens verified, by drafter.",
            &|i| by[i].drafted.load(Relaxed).to_string(),
        );
        labelled(
            &mut s,
            "counter",
            "forward_serve_speculative_drafter_accepted_total",
            "Draft tokens accepted, by drafter.",
            &|i| by[i].accepted.load(Relaxed).to_string(),
        );
        labelled(
            &mut s,
            "gauge",
            "forward_serve_speculative_drafter_tau",
            "Mean tokens per speculative round by drafter, 1 + accepted/rounds (0 before its first round).",
            &|i| {
                let rounds = by[i].rounds.load(Relaxed);
                let tau = if rounds == 0 {
                    0.0
                } else {
                    1.0 + by[i].accepted.load(Relaxed) as f64 / rounds as f64
                };
                tau.to_string()
            },
        );
        labelled(
            &mut s,
            "counter",
            "forward_serve_speculative_drafter_errors_total",
            "Draft proposals that failed, by drafter (the sequence decoded plainly instead).",
            &|i| self.spec_errors[i].load(Relaxed).to_string(),
        );
        s
    }
}
