//! `xdna bench gemm`: the host GEMM executors on the SmolLM2-135M shapes, against measured read
//! bandwidth.
//!
//! Each sweep runs every projection of all 30 layers and the lm_head in turn, as a decode step reads
//! them (synthetic random tiles in the right formats, ~96 MB), for one activation row count M. The
//! median sweep time gives seconds, effective GB/s of weight bytes streamed, GOP/s and the cost
//! relative to M = 1. A multi-threaded streaming read through the same worker pool measures the
//! bandwidth those GB/s are compared with.
//!
//! Both stay out of the last-level cache, which on a server part can hold the whole model (260 MiB
//! of L3 on a Sapphire Rapids host): the probe reads twice the cache (at least
//! 256 MiB), and a full-model sweep cycles through as many copies of the weights as cover twice the
//! cache, one copy per timed sweep (`--copies` sets the count; 1 is what a decode step on such a
//! host reads).

use std::time::Instant;

use xdna::kernels::host_layout::{self, pack_group_records, Packing};
use xdna::kernels::pool::Pool;
use xdna::kernels::{HostExecutor, WeightMatrix};
use xdna::tiles::WeightFormat;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Worker threads (default: available cores, or XDNA_THREADS).
    #[arg(long)]
    threads: Option<usize>,
    /// Weight format of the projections.
    #[arg(long, default_value = "q41h")]
    wfmt: String,
    /// Weight format of the lm_head.
    #[arg(long, default_value = "q8h")]
    head_wfmt: String,
    /// Activation row counts to measure (comma-separated).
    #[arg(long, default_value = "1,2,4,8,16,17,64,128", value_delimiter = ',')]
    m: Vec<usize>,
    /// Minimum measuring time per M, in seconds.
    #[arg(long, default_value_t = 1.0)]
    min_time: f64,
    /// Layers to sweep (SmolLM2-135M has 30).
    #[arg(long, default_value_t = LAYERS)]
    layers: usize,
    /// Rows of the lm_head to sweep (SmolLM2-135M has 49152). With `--layers 1 --head-rows 1024`
    /// the whole sweep (≈ 2.8 MB) stays in the last-level cache: the kernels' compute rate alone.
    #[arg(long, default_value_t = VOCAB)]
    head_rows: usize,
    /// Weight layout: `host` (what the host backend runs: q4_1/Q8 repacked into group records
    /// at load) or `tiles` (the package's tile grid, as a device receives it).
    #[arg(long, value_enum, default_value_t = Layout::Host)]
    layout: Layout,
    /// Copies of the weights the timed sweeps cycle through, one copy per sweep, so that the
    /// working set exceeds the last-level cache. Default: enough to cover twice the cache for a
    /// full-model sweep, 1 when `--layers` or `--head-rows` shrink it.
    #[arg(long)]
    copies: Option<usize>,
    /// Also compare M = 1 sweeps whose threads claim at least this many row blocks at a time
    /// (comma-separated, e.g. `1,4`), alternating the settings sweep by sweep so that all of
    /// them see the same machine.
    #[arg(long, value_delimiter = ',')]
    compare_chunks: Vec<usize>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Layout {
    Host,
    Tiles,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Host => "host",
            Layout::Tiles => "tiles",
        }
    }
}

/// SmolLM2-135M: 30 layers, hidden 576, FFN 1536, 9 heads × 64, 3 KV heads, vocab 49152.
const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const FFN: usize = 1536;
const QKV: usize = (9 + 2 * 3) * 64;
const VOCAB: usize = 49152;

#[derive(Clone)]
struct Matrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    packing: Packing,
}

impl Matrix {
    fn view(&self) -> WeightMatrix<'_> {
        WeightMatrix {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
            packing: self.packing,
        }
    }
}

/// Bytes [`synthetic`] stores for a `rows × cols` matrix of `format` in `layout`.
fn stored_bytes(
    name: &'static str,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    layout: Layout,
) -> xdna::Result<usize> {
    let records = layout == Layout::Host && host_layout::record_bytes(format).is_some();
    if records {
        host_layout::records_matrix_bytes(format, rows, cols)
    } else {
        format.matrix_bytes(rows, cols)
    }
    .map_err(|e| xdna::Error::Usage(format!("{name}: {e}")))
}

/// Random tile bytes with every scale/min replaced by a small valid value (so no NaN/denormal
/// arithmetic skews the timing).
fn synthetic(
    name: &'static str,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    layout: Layout,
    seed: &mut u64,
) -> xdna::Result<Matrix> {
    let bytes = format
        .matrix_bytes(rows, cols)
        .map_err(|e| xdna::Error::Usage(format!("{name}: {e}")))?;
    let mut data = vec![0u8; bytes];
    for chunk in data.chunks_mut(8) {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let v = seed.to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let scale_bytes = match format {
        WeightFormat::Q41 { .. } | WeightFormat::Q8Legacy => 1024,
        WeightFormat::Q8 { .. } => 512,
        _ => 0,
    };
    // 0x2000 is a small normal number both as f16 (~0.0078) and as bf16's top half (~1e-19 ·…).
    let small: [u8; 2] = 0x2000u16.to_le_bytes();
    if let Some(tile) = format.tile_bytes() {
        for t in data.chunks_mut(tile) {
            for s in t[..scale_bytes].chunks_mut(2) {
                s.copy_from_slice(&small);
            }
            if format == WeightFormat::Q4K {
                for s in t[4608..].chunks_mut(2) {
                    s.copy_from_slice(&small);
                }
            }
        }
    } else {
        for s in data.chunks_mut(2) {
            s.copy_from_slice(&small);
        }
    }
    if layout == Layout::Host {
        let records = WeightMatrix::new(format, rows, cols, &data)
            .and_then(|tiles| pack_group_records(&tiles))
            .map_err(|e| xdna::Error::Usage(format!("{name}: {e}")))?;
        if let Some(records) = records {
            return Ok(Matrix {
                format,
                rows,
                cols,
                data: records,
                packing: Packing::GroupRecords,
            });
        }
    }
    Ok(Matrix {
        format,
        rows,
        cols,
        data,
        packing: Packing::Tiles,
    })
}

/// Median of a non-empty sample.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Row {
    m: usize,
    seconds: f64,
    best_seconds: f64,
    gbs: f64,
    gops: f64,
    relative: f64,
    /// Multiply-adds per second over the probe's int8 multiply-add peak.
    fraction_of_int8_peak: f64,
    /// Thread-time per 32 × 32 weight block and activation row (1024 multiply-adds).
    ns_per_block_group: f64,
}

pub fn run(args: Args) -> xdna::Result<()> {
    if let Some(threads) = args.threads {
        // Read once, when the global pool is first used (below).
        // SAFETY: no other thread exists yet in this process that could read the environment.
        unsafe { std::env::set_var("XDNA_THREADS", threads.to_string()) };
    }
    let wfmt = WeightFormat::from_name(&args.wfmt)
        .map_err(|e| xdna::Error::Usage(format!("--wfmt: {e}")))?;
    let head_wfmt = WeightFormat::from_name(&args.head_wfmt)
        .map_err(|e| xdna::Error::Usage(format!("--head-wfmt: {e}")))?;
    // Every buffer below is sized by these: refuse sizes no machine holds instead of aborting
    // on a failed allocation.
    const MAX_M: usize = 4096;
    const MAX_LAYERS: usize = 1024;
    const MAX_COPIES: usize = 64;
    const MAX_WORKING_SET: usize = 8 << 30;
    if args.m.is_empty() || args.m.iter().any(|&m| m == 0 || m > MAX_M) {
        return Err(xdna::Error::Usage(format!(
            "--m needs row counts between 1 and {MAX_M}"
        )));
    }
    if args.layers > MAX_LAYERS {
        return Err(xdna::Error::Usage(format!(
            "--layers {} exceeds {MAX_LAYERS}",
            args.layers
        )));
    }
    if args.compare_chunks.contains(&0) {
        return Err(xdna::Error::Usage(
            "--compare-chunks needs positive block counts".into(),
        ));
    }
    if args.head_rows == 0 || !args.head_rows.is_multiple_of(32) || args.head_rows > VOCAB {
        return Err(xdna::Error::Usage(format!(
            "--head-rows {} must be a positive multiple of 32, at most {VOCAB}",
            args.head_rows
        )));
    }
    let layer = [
        ("qkv", QKV, HIDDEN),
        ("o", HIDDEN, HIDDEN),
        ("gate+up", 2 * FFN, HIDDEN),
        ("down", HIDDEN, FFN),
    ];
    // Sized before anything is allocated, so that a working set no machine holds is refused by
    // name instead of aborting on a failed allocation.
    let mut planned = stored_bytes("lm_head", head_wfmt, args.head_rows, HIDDEN, args.layout)?;
    for (name, rows, cols) in layer {
        planned += args.layers * stored_bytes(name, wfmt, rows, cols, args.layout)?;
    }
    let llc = xdna::kernels::bandwidth::last_level_cache_bytes();
    // A sweep at least the model's size is meant to stream from memory; a shrunken one, to stay
    // in the cache.
    let full_model = args.layers >= LAYERS && args.head_rows == VOCAB;
    let copies = match args.copies {
        Some(0) => return Err(xdna::Error::Usage("--copies needs at least 1".into())),
        Some(n) if n > MAX_COPIES => {
            return Err(xdna::Error::Usage(format!(
                "--copies {n} exceeds {MAX_COPIES}"
            )))
        }
        Some(n) => n,
        // Capped at the memory bound below: a cache larger than that is not out-run here.
        None if full_model => llc.map_or(1, |llc| {
            (2 * llc)
                .div_ceil(planned.max(1))
                .clamp(1, (MAX_WORKING_SET / planned.max(1)).max(1))
        }),
        None => 1,
    };
    if copies * planned > MAX_WORKING_SET {
        return Err(xdna::Error::Usage(format!(
            "{copies} copies of {:.0} MB of weights exceed the {} GiB this bench allocates at most \
             (lower --copies or --layers)",
            planned as f64 / 1e6,
            MAX_WORKING_SET >> 30
        )));
    }
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut matrices = Vec::new();
    for _ in 0..args.layers {
        for (name, rows, cols) in layer {
            matrices.push(synthetic(name, wfmt, rows, cols, args.layout, &mut seed)?);
        }
    }
    matrices.push(synthetic(
        "lm_head",
        head_wfmt,
        args.head_rows,
        HIDDEN,
        args.layout,
        &mut seed,
    )?);
    let stored: usize = matrices.iter().map(|w| w.data.len()).sum();
    debug_assert_eq!(stored, planned);
    // Further copies are clones: the same bytes at other addresses, which is all a cache sees.
    let first_copy = matrices.clone();
    for _ in 1..copies {
        matrices.extend(first_copy.iter().cloned());
    }
    let all_views: Vec<WeightMatrix> = matrices.iter().map(Matrix::view).collect();
    let per_copy = first_copy.len();
    let copy_views: Vec<&[WeightMatrix]> = all_views.chunks(per_copy).collect();
    let views = copy_views[0];
    let streamed: usize = views.iter().map(|w| w.streamed_bytes()).sum();
    let macs_per_row: usize = views.iter().map(|w| w.rows * w.cols).sum();
    let max_m = args.m.iter().copied().max().unwrap_or(1);
    let mut y = vec![0f32; max_m * args.head_rows.max(2 * FFN)];
    let x: Vec<f32> = (0..max_m * FFN)
        .map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
        .collect();

    let executor = HostExecutor::global();
    let threads = Pool::global().threads();
    let probe_bytes = xdna::kernels::bandwidth::probe_bytes();
    let probe = xdna::kernels::bandwidth::read_bandwidth(probe_bytes, 7);
    let (bandwidth, best_bandwidth) = (probe.median_gbs, probe.best_gbs);
    let int8_peak = xdna::kernels::bandwidth::int8_mac_peak(7).map(|p| p.median_gbs);

    // Timed sweeps take the copies in turn.
    let mut next_copy = 0;
    let mut sweep = |m: usize| -> xdna::Result<f64> {
        let views = copy_views[next_copy];
        next_copy = (next_copy + 1) % copies;
        let start = Instant::now();
        for w in views {
            executor.gemm(w, &x[..m * w.cols], m, &mut y[..m * w.rows])?;
        }
        Ok(start.elapsed().as_secs_f64())
    };
    let mut rows = Vec::new();
    for &m in &args.m {
        for _ in 0..copies {
            sweep(m)?; // warm-up (scratch buffers, page faults)
        }
        let mut samples = Vec::new();
        let begin = Instant::now();
        while samples.len() < 3
            || (begin.elapsed().as_secs_f64() < args.min_time && samples.len() < 200)
        {
            samples.push(sweep(m)?);
        }
        let best_seconds = samples.iter().copied().fold(f64::INFINITY, f64::min);
        let seconds = median(samples);
        rows.push(Row {
            m,
            seconds,
            best_seconds,
            // One 32-row × 32-column block of weights times one activation row, per thread.
            ns_per_block_group: seconds * 1e9 * threads as f64 / (m * macs_per_row / 1024) as f64,
            gbs: streamed as f64 / seconds / 1e9,
            gops: 2.0 * (m * macs_per_row) as f64 / seconds / 1e9,
            relative: 0.0,
            fraction_of_int8_peak: int8_peak.map_or(f64::NAN, |peak| {
                (m * macs_per_row) as f64 / seconds / 1e9 / peak
            }),
        });
    }
    let m1 = rows.iter().find(|r| r.m == 1).map(|r| r.seconds);
    for r in &mut rows {
        r.relative = m1.map_or(f64::NAN, |s| r.seconds / s);
    }
    // Interleaved M = 1 sweeps, one claim-size setting after another, round after round.
    let mut chunk_samples = vec![Vec::new(); args.compare_chunks.len()];
    if !args.compare_chunks.is_empty() {
        let tuned: Vec<HostExecutor> = args
            .compare_chunks
            .iter()
            .map(|&c| HostExecutor::new().with_single_row_min_chunk(c))
            .collect();
        let begin = Instant::now();
        let mut round = 0;
        while chunk_samples[0].len() < 5
            || (begin.elapsed().as_secs_f64() < args.min_time * tuned.len() as f64
                && chunk_samples[0].len() < 200)
        {
            for (exec, samples) in tuned.iter().zip(&mut chunk_samples) {
                let views = copy_views[round % copies];
                round += 1;
                let start = Instant::now();
                for w in views {
                    exec.gemm(w, &x[..w.cols], 1, &mut y[..w.rows])?;
                }
                samples.push(start.elapsed().as_secs_f64());
            }
        }
    }
    let chunk_rows: Vec<(usize, f64, f64)> = args
        .compare_chunks
        .iter()
        .zip(chunk_samples)
        .map(|(&c, samples)| {
            let best = samples.iter().copied().fold(f64::INFINITY, f64::min);
            (c, median(samples), best)
        })
        .collect();
    let fraction_m1 = rows
        .iter()
        .find(|r| r.m == 1)
        .map_or(f64::NAN, |r| r.gbs / bandwidth);
    // Best-of-N on both sides: closer to what the machine can do when it is shared and noisy.
    let best_fraction_m1 = rows.iter().find(|r| r.m == 1).map_or(f64::NAN, |r| {
        streamed as f64 / r.best_seconds / 1e9 / best_bandwidth
    });

    if args.json {
        let json = serde_json::json!({
            "shapes": format!(
                "SmolLM2-135M: {} x (qkv 960x576, o 576x576, gate+up 3072x576, down 576x1536) + lm_head {}x576",
                args.layers, args.head_rows
            ),
            "wfmt": wfmt.name(),
            "head_wfmt": head_wfmt.name(),
            "layout": args.layout.name(),
            "threads": threads,
            "avx2": executor.uses_avx2(),
            "vnni": executor.uses_vnni(),
            "calls_per_sweep": views.len(),
            "streamed_bytes": streamed,
            "stored_bytes": stored,
            "copies": copies,
            "working_set_bytes": copies * stored,
            "last_level_cache_bytes": llc,
            "probe_bytes": probe_bytes,
            "read_bandwidth_gbs": bandwidth,
            "fraction_of_bandwidth_m1": fraction_m1,
            "best_read_bandwidth_gbs": best_bandwidth,
            "best_fraction_of_bandwidth_m1": best_fraction_m1,
            "int8_mac_peak_gmacs": int8_peak,
            "int8_peak_instruction": xdna::kernels::bandwidth::int8_peak_instruction(),
            "rows": rows.iter().map(|r| serde_json::json!({
                "m": r.m,
                "seconds": r.seconds,
                "best_seconds": r.best_seconds,
                "seconds_per_call": r.seconds / views.len() as f64,
                "gbs": r.gbs,
                "gops": r.gops,
                "relative_to_m1": r.relative,
                "fraction_of_int8_peak": r.fraction_of_int8_peak,
                "ns_per_block_group": r.ns_per_block_group,
            })).collect::<Vec<_>>(),
            "chunk_comparison": chunk_rows.iter().map(|&(c, seconds, best)| serde_json::json!({
                "min_chunk": c,
                "seconds": seconds,
                "best_seconds": best,
                "relative_to_first": seconds / chunk_rows[0].1,
            })).collect::<Vec<_>>(),
        });
        println!("{json:#}");
        return Ok(());
    }
    println!(
        "host GEMM sweep: {} layers x (qkv, o, gate+up, down) {} + lm_head {} ({} rows), {} layout; {} calls, {:.1} MB streamed ({:.1} MB stored); {} thread(s), {}",
        args.layers,
        wfmt.name(),
        head_wfmt.name(),
        args.head_rows,
        args.layout.name(),
        views.len(),
        streamed as f64 / 1e6,
        stored as f64 / 1e6,
        threads,
        match (executor.uses_avx2(), executor.uses_vnni()) {
            (true, true) => "AVX2, AVX-512 VNNI for M > 1",
            (true, false) => "AVX2",
            _ => "scalar",
        },
    );
    println!(
        "working set: {copies} cop{} of the weights, {:.0} MB; last-level cache {}",
        if copies == 1 { "y" } else { "ies" },
        (copies * stored) as f64 / 1e6,
        llc.map_or("unknown".to_string(), |b| format!(
            "{:.0} MB",
            b as f64 / 1e6
        )),
    );
    println!(
        "read bandwidth ({} MiB streaming read, pool): median {bandwidth:.2} GB/s, best {best_bandwidth:.2} GB/s",
        probe_bytes >> 20
    );
    match int8_peak {
        Some(peak) => println!(
            "int8 multiply-add peak ({} on registers only, pool): median {peak:.1} GMAC/s",
            xdna::kernels::bandwidth::int8_peak_instruction()
        ),
        None => println!("int8 multiply-add peak: not measured (no AVX2)"),
    }
    println!("times are medians over repeated sweeps (best = fastest sweep)");
    println!(
        "{:>5} {:>11} {:>10} {:>12} {:>8} {:>9} {:>8} {:>10} {:>13}",
        "M",
        "sweep ms",
        "best ms",
        "µs/call",
        "GB/s",
        "GOP/s",
        "× M=1",
        "int8 peak",
        "ns/32x32·row"
    );
    for r in &rows {
        println!(
            "{:>5} {:>11.3} {:>10.3} {:>12.1} {:>8.2} {:>9.1} {:>8.2} {:>9.0}% {:>13.2}",
            r.m,
            r.seconds * 1e3,
            r.best_seconds * 1e3,
            r.seconds * 1e6 / views.len() as f64,
            r.gbs,
            r.gops,
            r.relative,
            r.fraction_of_int8_peak * 100.0,
            r.ns_per_block_group
        );
    }
    println!(
        "M=1: {:.0}% of measured read bandwidth (medians); best-of-N: {:.0}%",
        fraction_m1 * 100.0,
        best_fraction_m1 * 100.0
    );
    if let Some(&(_, first, _)) = chunk_rows.first() {
        println!(
            "M=1 sweeps by the fewest row blocks a thread claims at once (interleaved, medians):"
        );
        println!(
            "{:>10} {:>11} {:>10} {:>9}",
            "min chunk", "sweep ms", "best ms", "× first"
        );
        for &(c, seconds, best) in &chunk_rows {
            println!(
                "{:>10} {:>11.3} {:>10.3} {:>9.3}",
                c,
                seconds * 1e3,
                best * 1e3,
                seconds / first
            );
        }
    }
    Ok(())
}
