//! Fuzz the tokenizer: the default model's `tokenizer.json` (`$XDNA_FUZZ_TOKENIZER`, else the
//! package `xdna pack default` makes) encodes any text and decodes any ids without a panic, and
//! decoding the encoding of text whose every byte the vocabulary spells gives the text back. The same bytes are also tried as a
//! `tokenizer.json` of their own, which must load or be refused.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run tokenizer corpus/tokenizer`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use xdna::weights::Tokenizer;

fn default_tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = std::env::var_os("XDNA_FUZZ_TOKENIZER")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let cache = std::env::var_os("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| {
                        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
                    });
                cache.join("xdna/SmolLM2-135M-Instruct.Q4_1.pkg/tokenizer.json")
            });
        Tokenizer::from_json_file(&path).unwrap_or_else(|e| {
            panic!("the fuzz target needs a tokenizer.json (run `xdna pack default`): {e}")
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let tokenizer = default_tokenizer();
    let text = String::from_utf8_lossy(data);
    let spellable = text.bytes().all(|b| tokenizer.has_byte(b));
    for allow_special in [false, true] {
        let ids = tokenizer.encode(&text, allow_special);
        let decoded = tokenizer.decode(&ids);
        if spellable {
            assert_eq!(decoded, text, "decode(encode(text)) == text");
        }
    }
    let ids: Vec<u32> = data
        .chunks(4)
        .map(|c| c.iter().fold(0u32, |a, &b| (a << 8) | u32::from(b)))
        .collect();
    let _ = tokenizer.decode(&ids);
    let mut stream = tokenizer.decode_stream();
    for &id in &ids {
        let _ = stream.push(id);
    }
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) {
        if let Ok(own) = Tokenizer::from_json(Path::new("<fuzz>/tokenizer.json"), &json) {
            let _ = own.decode(&own.encode("hello world", true));
        }
    }
});
