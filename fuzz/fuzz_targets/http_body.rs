//! Fuzz an HTTP request body → a validated generation request, for every route that reads one
//! (OpenAI completions and chat, llama.cpp `/completion`, Ollama generate and chat), over the fake
//! engine's codec: any bytes give a request within the server's limits or a 4xx naming the
//! problem, never a panic or a 5xx.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run http_body corpus/http_body`.
#![no_main]

use forward_serve::api::{parse_params, App, Config, Kind, Params, MAX_SAMPLES};
use forward_serve::fake::FakeCodec;
use forward_serve::metrics::Metrics;
use forward_serve::scheduler::GenRequest;
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};

/// The shared state every handler sees, with a queue nothing reads (validation never sends).
fn app() -> &'static App {
    static APP: OnceLock<(App, tokio::sync::mpsc::Receiver<GenRequest>)> = OnceLock::new();
    &APP.get_or_init(|| {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let app = App::new(
            Config::default(),
            Arc::new(FakeCodec::new(256)),
            Arc::new(Metrics::default()),
            tx,
        );
        (app, rx)
    })
    .0
}

fn check(app: &App, r: Result<Params, forward_serve::error::ApiError>) {
    match r {
        Ok(p) => {
            assert!(!p.prompt.is_empty() && p.prompt.len() < 256, "prompt of {}", p.prompt.len());
            assert!(p.max_tokens <= app.cfg.max_tokens_limit && p.prompt.len() + p.max_tokens <= 256);
            assert!((1..=MAX_SAMPLES as usize).contains(&p.n));
            assert!(p.sampling.validate().is_ok(), "{:?}", p.sampling);
        }
        Err(e) => assert!(e.status.is_client_error(), "{e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let app = app();
    for kind in [Kind::Completions, Kind::Chat, Kind::Llama] {
        check(app, parse_params(app, &v, kind));
    }
    for chat in [false, true] {
        match forward_serve::ollama::validate(app, &v, chat) {
            Ok(Some(p)) => check(app, Ok(p)),
            Ok(None) => {}
            Err(e) => check(app, Err(e)),
        }
    }
});
