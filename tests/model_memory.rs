//! Resident memory of the embedding lookups: the table is read through the package's file mapping
//! a row at a time and never held (a tied lm_head already holds the same matrix).
//!
//! A test binary of its own: resident file pages are per process, and other tests in the same
//! process would map files meanwhile.

#[path = "support/smollm2.rs"]
mod smollm2;

use xdna::model::load::{load, open_package, Backend, LoadOptions};

/// `RssFile` of `/proc/self/status`: this process's resident pages of mapped files, in bytes.
fn resident_file_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("RssFile:"))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .expect("an RssFile line in kB");
    kb * 1024
}

#[test]
fn embedding_lookups_leave_no_table_pages_resident() {
    let Some(gguf) = smollm2::smollm2_gguf() else {
        return;
    };
    let pkg = open_package(&gguf).expect("open package");
    let opts = LoadOptions {
        backend: Backend::Host,
        kernels: None,
        exact: false,
    };
    let w = load(&pkg, &opts).expect("load");
    let (vocab, hidden) = (w.config.vocab, w.config.hidden);
    let mut row = vec![0f32; hidden];
    // The first lookup maps the lookup code's own pages.
    w.embed.row(1, &mut row).expect("row 1");
    let before = resident_file_bytes();
    // 256 tokens spread over the vocabulary, each in its own 32-row block of tiles. One row reads
    // its scales and codes in every tile of its block (3 tiles of 8.5 KiB for SmolLM2's 576
    // columns), so without the release at least 256 × 3 pages (3 MiB) would stay resident, and
    // with the kernel's fault-around far more. They stay 4096 rows (≈ 3 MiB of tiles) away from
    // the table's ends: a page-cache folio reaching past an end is not the table's to release.
    let lookups = 256;
    let margin = 4096;
    assert!(vocab > 4 * margin, "vocabulary of {vocab}");
    let mut kept = Vec::new();
    let start = std::time::Instant::now();
    for i in 0..lookups {
        let token = (margin + i * (vocab - 2 * margin) / lookups) as u32;
        w.embed.row(token, &mut row).expect("row");
        if i % 64 == 0 {
            kept.push((token, row.clone()));
        }
    }
    let spent = start.elapsed();
    let grown = resident_file_bytes().saturating_sub(before);
    eprintln!(
        "{lookups} embedding lookups in {spent:?}: resident file pages grew by {grown} bytes"
    );
    assert!(
        grown < 512 << 10,
        "{lookups} embedding lookups left {grown} bytes of mapped file pages resident"
    );
    // The rows are still the table's, decoded by the weights layer's own decoder (after the
    // measurement: it reads the mapping without releasing it).
    let view = pkg
        .matrix(pkg.embedding_name(), vocab, hidden)
        .expect("embedding matrix");
    let mut want = vec![0f32; hidden];
    for (token, got) in kept {
        view.decode_row(token as usize, &mut want).expect("decode");
        assert_eq!(got, want, "token {token}");
    }
}
