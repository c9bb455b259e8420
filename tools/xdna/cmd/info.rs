//! `xdna info`: everything the NPU device reports.

use std::io::Write;
use std::path::PathBuf;
use xdna::device::{DeviceInfo, XdnaDevice};

#[derive(clap::Args)]
pub struct Args {
    /// Device node (default: first amdxdna node of /dev/accel/accel0..63).
    #[arg(long, env = "XDNA_DEVICE")]
    device: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> xdna::Result<()> {
    let dev = match &args.device {
        Some(p) => XdnaDevice::open(p)?,
        None => XdnaDevice::discover()?,
    };
    let info = dev.info()?;
    let text = if args.json {
        let mut t = serde_json::to_string_pretty(&info)
            .map_err(|e| xdna::Error::Usage(format!("JSON encoding failed: {e}")))?;
        t.push('\n');
        t
    } else {
        render(&info)
    };
    // A closed pipe (`xdna info | head`) is not an error worth a panic.
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(xdna::Error::io("<stdout>", e)),
        _ => Ok(()),
    }
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn hex(v: &Option<u32>, width: usize) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:#0w$x}", w = width + 2))
}

fn render(i: &DeviceInfo) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let power = |m: u8| match m {
        0 => "default",
        1 => "low",
        2 => "medium",
        3 => "high",
        4 => "turbo",
        _ => "unknown",
    };
    let _ = writeln!(s, "device         {}", i.path.display());
    let _ = writeln!(
        s,
        "driver         {} {}{}",
        i.driver,
        i.version,
        if i.version.is_oot() {
            " (out-of-tree)"
        } else {
            ""
        }
    );
    let _ = writeln!(s, "board (vbnv)   {}", opt(&i.sysfs.vbnv));
    let _ = writeln!(
        s,
        "pci            vendor {} device {} rev {}",
        hex(&i.sysfs.vendor, 4),
        hex(&i.sysfs.device, 4),
        hex(&i.sysfs.revision, 2)
    );
    let _ = writeln!(
        s,
        "device type    {}",
        match i.sysfs.device_type {
            Some(0) => "0 (KMQ)".to_string(),
            Some(1) => "1 (UMQ)".to_string(),
            Some(2) => "2 (PF)".to_string(),
            other => opt(&other),
        }
    );
    let fw = i.firmware.clone().or_else(|| i.sysfs.fw_version.clone());
    let _ = writeln!(s, "firmware       {}", opt(&fw));
    let _ = writeln!(
        s,
        "aie            version {}.{}, {} columns × {} rows, core rows {} (from row {}), mem rows {}, shim rows {}",
        i.aie.version_major,
        i.aie.version_minor,
        i.aie.cols,
        i.aie.rows,
        i.aie.core_rows,
        i.aie.core_row_start,
        i.aie.mem_rows,
        i.aie.shim_rows
    );
    if i.clocks.is_empty() {
        let _ = writeln!(s, "clocks         -");
    }
    for c in &i.clocks {
        let _ = writeln!(s, "clock          {}: {} MHz", c.name, c.mhz);
    }
    let _ = writeln!(
        s,
        "power mode     {}",
        i.power_mode
            .map_or_else(|| "-".to_string(), |m| format!("{m} ({})", power(m)))
    );
    let _ = writeln!(s, "context limit  {}", opt(&i.context_limit));
    if let Some(r) = &i.resources {
        let _ = writeln!(
            s,
            "resources      clk max {} MHz, TOPS {}/{}, tasks {}/{}",
            r.npu_clk_max, r.npu_tops_curr, r.npu_tops_max, r.npu_task_curr, r.npu_task_max
        );
    }
    let _ = writeln!(s, "heap           device address {:#x}", i.heap_device_addr);
    match &i.contexts {
        None => {
            let _ = writeln!(s, "contexts       - (not reported by this driver)");
        }
        Some(v) => {
            let _ = writeln!(s, "contexts       {} live", v.len());
            for c in v {
                let _ = writeln!(
                    s,
                    "  ctx {:>4}  pid {:>7}  cols {}..{}  submitted {}  completed {}  errors {}",
                    c.context_id,
                    c.pid,
                    c.start_col,
                    c.start_col + c.num_col,
                    c.submissions,
                    c.completions,
                    c.errors
                );
            }
        }
    }
    s
}
