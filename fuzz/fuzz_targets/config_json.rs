//! Fuzz `config.json` → the model description: any bytes must give Ok or Err, never a panic; a
//! description that parses also yields its kernel shapes and writes a `config.json` that parses
//! back to the same description.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run config_json corpus/config_json`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xdna::tiles::WeightFormat;
use xdna::weights::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(config) = ModelConfig::from_json(&json, "<fuzz>/config.json") else {
        return;
    };
    if let Ok(q41) = WeightFormat::from_name("q41h") {
        // Bounded: a description with absurd sizes still lists five shapes per layer.
        if config.layers <= 4096 {
            let _ = config.kernel_shapes(q41, q41);
        }
    }
    let written = config.to_json();
    let again = ModelConfig::from_json(&written, "<fuzz>/written.json")
        .expect("a description's own config.json parses");
    assert_eq!(again.to_json(), written, "config.json round trip");
});
