//! `npu-hold`: run a command with exclusive, first-come-first-served use of the NPU.
//!
//! ```text
//! npu-hold [-t DURATION] [-l LABEL] [--device PATH] [--grace DURATION] -- CMD ARGS...
//! npu-hold --status [--json]
//! ```
//!
//! See `docs/npu-hold.md` for exit codes, the lock location and the guarantees.

mod counters;
mod duration;
mod queue;
mod supervise;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use nix::sys::signal::Signal;

use crate::duration::{format_duration, parse_duration};
use crate::queue::{format_utc, now_ms, DeviceLock, HoldDir, HolderInfo, Ticket};
use crate::supervise::{Ending, Run, Signals};

/// The time limit was reached (as `timeout(1)`).
const EXIT_TIMEOUT: i32 = 124;
/// npu-hold itself failed (bad usage, lock directory unusable, ...).
const EXIT_FAILURE: i32 = 125;
/// The command was found but could not be executed.
const EXIT_CANNOT_EXEC: i32 = 126;
/// The command was not found.
const EXIT_NOT_FOUND: i32 = 127;

/// Environment handed to the command: `<lock dir>#<ticket>` of the run it belongs to, so a nested
/// `npu-hold` inside a held run does not queue behind its own parent.
const ENV_TICKET: &str = "XDNA_HOLD_TICKET";

macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "npu-hold: {}", format_args!($($arg)*));
    }};
}

#[derive(Parser, Debug)]
#[command(
    name = "npu-hold",
    version,
    about = "Run a command with exclusive, first-come-first-served use of the NPU",
    after_help = "Exit status: the command's own (128+N if killed by signal N); 124 on timeout; \
                  128+N if npu-hold got signal N; 125 npu-hold failure; 126 cannot execute; 127 not found."
)]
struct Cli {
    /// Time limit of the run once the device is held (e.g. 90s, 4m, 1h30m); none by default.
    #[arg(short = 't', long = "timeout", value_name = "DURATION", value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Label shown in --status (default: the command line).
    #[arg(short = 'l', long)]
    label: Option<String>,
    /// Device node the ticket is for.
    #[arg(
        long,
        value_name = "PATH",
        env = "XDNA_DEVICE",
        default_value = "/dev/accel/accel0"
    )]
    device: PathBuf,
    /// Time between SIGTERM and SIGKILL when stopping the command.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    grace: Duration,
    /// Show the holder and the queue instead of running anything.
    #[arg(long, conflicts_with_all = ["timeout", "label", "command"])]
    status: bool,
    /// With --status: print JSON.
    #[arg(long, requires = "status")]
    json: bool,
    /// Log filter (e.g. `debug`); also NPU_HOLD_LOG.
    #[arg(long, env = "NPU_HOLD_LOG", default_value = "warn")]
    log: String,
    /// The command to run, after `--`.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<OsString>,
    /// Internal: run as the watchdog of this process group (see `supervise::Watchdog`).
    #[arg(long, hide = true, value_name = "PGID")]
    watch_group: Option<i32>,
}

fn main() {
    std::process::exit(real_main());
}

fn real_main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { EXIT_FAILURE } else { 0 };
        }
    };
    if let Some(pgid) = cli.watch_group {
        return supervise::watch_group(pgid);
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();

    if cli.status {
        return match show_status(&cli) {
            Ok(()) => 0,
            Err(e) => {
                say!("{e}");
                EXIT_FAILURE
            }
        };
    }
    if cli.command.is_empty() {
        say!("no command given (usage: npu-hold [-t DURATION] [-l LABEL] -- CMD ARGS...)");
        return EXIT_FAILURE;
    }
    match hold(&cli) {
        Ok(code) => code,
        Err(e) => {
            say!("{e}");
            EXIT_FAILURE
        }
    }
}

type BoxError = Box<dyn std::error::Error>;

fn command_strings(cli: &Cli) -> Vec<String> {
    cli.command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

fn default_label(command: &[String]) -> String {
    let mut label = command.join(" ");
    if label.chars().count() > 80 {
        label = label.chars().take(77).collect::<String>() + "...";
    }
    label
}

fn hold(cli: &Cli) -> Result<i32, BoxError> {
    // Block the stop signals first: from here on they are handled, never fatal.
    let signals = Signals::block().map_err(|e| format!("cannot block signals: {e}"))?;
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        say!("warning: cannot become a child subreaper ({e}): double-forked processes may escape");
    }
    let dir = HoldDir::resolve(&cli.device)?;
    let command = command_strings(cli);
    let label = cli.label.clone().unwrap_or_else(|| default_label(&command));

    let nested = nested_seq(&dir);
    let mut held: Option<(Ticket, DeviceLock)> = None;
    if let Some(seq) = nested {
        tracing::info!("inside held run (ticket {seq}): running without queueing");
    } else {
        let mut interrupted = None;
        let mut give_up = || match signals.wait(Duration::from_millis(10)) {
            Some(Signal::SIGCHLD) | None => false,
            Some(sig) => {
                interrupted = Some(sig);
                true
            }
        };
        let taken = dir.take_ticket(label.clone(), command.clone(), cli.timeout, &mut give_up);
        let ticket = match (taken, interrupted) {
            (Ok(ticket), _) => ticket,
            (Err(_), Some(sig)) => {
                say!("{sig} while taking a ticket for {}", cli.device.display());
                return Ok(128 + sig as i32);
            }
            (Err(e), None) => return Err(e.into()),
        };
        match wait_turn(&dir, &ticket, &signals, cli)? {
            Ok(lock) => held = Some((ticket, lock)),
            Err(sig) => {
                say!(
                    "{sig} while waiting for {}: left the queue",
                    cli.device.display()
                );
                return Ok(128 + sig as i32);
            }
        }
    }
    let code = run_held(
        cli,
        &dir,
        held.as_ref().map(|(t, _)| t),
        &label,
        &signals,
        nested,
    );
    // Release order: holder record and ticket files go, then the ticket lock, then the device.
    if let Some((ticket, lock)) = held {
        drop(ticket);
        drop(lock);
    }
    Ok(code)
}

/// The ticket of the enclosing held run, if we are inside one that holds this device now.
fn nested_seq(dir: &HoldDir) -> Option<u64> {
    let value = std::env::var(ENV_TICKET).ok()?;
    let (root, seq) = value.rsplit_once('#')?;
    let seq: u64 = seq.parse().ok()?;
    if dir.root != Path::new(root) {
        return None;
    }
    // The enclosing run must hold the device now: lock held, its ticket first in the queue.
    if !dir.device_locked().ok()? {
        return None;
    }
    let head = dir.live_tickets().first()?.seq;
    (head == seq).then_some(seq)
}

/// Wait until our ticket is the oldest live one and the device lock is ours.
/// `Ok(Err(sig))` when a stop signal arrived first.
fn wait_turn(
    dir: &HoldDir,
    ticket: &Ticket,
    signals: &Signals,
    cli: &Cli,
) -> Result<Result<DeviceLock, Signal>, BoxError> {
    let started = Instant::now();
    let mut announced = false;
    loop {
        let live = dir.live_tickets();
        let Some(pos) = live.iter().position(|t| t.seq == ticket.info.seq) else {
            return Err(format!(
                "ticket {} vanished from {} (removed by hand?)",
                ticket.info.seq,
                dir.root.display()
            )
            .into());
        };
        if pos == 0 {
            if let Some(lock) = dir.try_lock_device()? {
                tracing::debug!(
                    "holding {} after {:?}",
                    cli.device.display(),
                    started.elapsed()
                );
                return Ok(Ok(lock));
            }
        }
        if !announced && (pos > 0 || started.elapsed() > Duration::from_secs(1)) {
            announced = true;
            let holder = match live.first().and_then(|t| t.info.as_ref()) {
                Some(info) if pos > 0 => format!("'{}' (pid {})", info.label, info.pid),
                _ => "a process outside the queue".to_string(),
            };
            say!(
                "waiting for {}: held by {holder}; {} ahead of us (ticket {})",
                cli.device.display(),
                pos.saturating_sub(1),
                ticket.info.seq
            );
        }
        match signals.wait(Duration::from_millis(50)) {
            Some(Signal::SIGCHLD) | None => {}
            Some(sig) => return Ok(Err(sig)),
        }
    }
}

fn run_held(
    cli: &Cli,
    dir: &HoldDir,
    ticket: Option<&Ticket>,
    label: &str,
    signals: &Signals,
    nested: Option<u64>,
) -> i32 {
    let before = counters::read_error_counters(&cli.device);
    let since_ms = now_ms();
    let start = Instant::now();
    let deadline = cli.timeout.map(|t| start + t);
    let deadline_ms = cli
        .timeout
        .map(|t| since_ms.saturating_add(u64::try_from(t.as_millis()).unwrap_or(u64::MAX)));
    let seq = ticket.map(|t| t.info.seq).or(nested).unwrap_or(0);
    let env = [
        (ENV_TICKET, format!("{}#{seq}", dir.root.display())),
        ("NPU_HOLD_LABEL", label.to_string()),
    ];
    let mut holder = HolderInfo {
        seq,
        child_pid: None,
        since_ms,
        deadline_ms,
        state: "starting".into(),
    };
    let publish = |h: &HolderInfo| {
        if let Some(t) = ticket {
            if let Err(e) = dir.write_holder(t, h) {
                tracing::warn!("{e}");
            }
        }
    };
    // Published before the command starts, so anything it runs already sees the holder.
    publish(&holder);
    let foreground = supervise::stdin_is_our_terminal();
    let child = match supervise::spawn(&cli.command, &env, foreground) {
        Ok(pid) => pid,
        Err(e) => {
            if foreground {
                supervise::restore_terminal();
            }
            let name = cli
                .command
                .first()
                .map(|c| c.to_string_lossy())
                .unwrap_or_default();
            say!("cannot run '{name}': {e}");
            return match e.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                _ => EXIT_CANNOT_EXEC,
            };
        }
    };
    holder.child_pid = u32::try_from(child.as_raw()).ok();
    holder.state = "running".into();
    publish(&holder);
    // If npu-hold is SIGKILLed, the watchdog kills the command's group (its own children too).
    let watchdog = match supervise::Watchdog::start(child) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(
                "no watchdog ({e}): if npu-hold is killed, only the command itself dies with it"
            );
            None
        }
    };

    let mut run = Run::new(child, watchdog.as_ref().map(supervise::Watchdog::pid));
    // Contexts live only as long as their process: those the command creates are gone by the
    // time it exits, so counters are also sampled during the run (per context, highest count seen).
    let mut seen = before.clone();
    let ending = run.wait(signals, deadline, || {
        if let Some(now) = counters::read_error_counters(&cli.device) {
            seen.get_or_insert_with(Default::default).merge_max(&now);
        }
    });
    let grace = format_duration(cli.grace);
    match ending {
        Ending::Exited => {}
        Ending::Timeout => {
            let limit = cli.timeout.map(format_duration).unwrap_or_default();
            say!("timeout: '{label}' ran longer than {limit}; stopping its process group (SIGTERM, SIGKILL after {grace})");
        }
        Ending::Signal(sig) => {
            say!("{sig} received: stopping '{label}' (SIGTERM, SIGKILL after {grace})");
        }
    }
    holder.state = match ending {
        Ending::Exited => "stopping (command exited)".into(),
        Ending::Timeout => "stopping (timeout)".into(),
        Ending::Signal(sig) => format!("stopping ({sig})"),
    };
    publish(&holder);
    let cleanup = run.stop_all(signals, cli.grace);
    if let Some(w) = watchdog {
        w.stand_down();
    }
    if foreground {
        supervise::restore_terminal();
    }
    if cleanup.escalated {
        say!("SIGKILL sent: processes of '{label}' were still alive after SIGTERM");
    }
    if ending == Ending::Exited && cleanup.signalled > 0 {
        say!(
            "'{label}' exited and left {} process(es) behind; they were stopped",
            cleanup.signalled
        );
    }

    let after = match (seen, counters::read_error_counters(&cli.device)) {
        (Some(mut seen), Some(last)) => {
            seen.merge_max(&last);
            Some(seen)
        }
        (seen, last) => last.or(seen),
    };
    if let (Some(b), Some(a)) = (&before, &after) {
        let changes = counters::describe_change(b, a);
        if !changes.is_empty() {
            say!(
                "device error counters changed during the run of '{label}' (total {} -> {}):",
                b.total(),
                a.total()
            );
            for line in changes {
                say!("  {line}");
            }
        }
    }

    match ending {
        Ending::Timeout => EXIT_TIMEOUT,
        Ending::Signal(sig) => 128 + sig as i32,
        Ending::Exited => run
            .status
            .as_ref()
            .and_then(supervise::exit_code)
            .unwrap_or(EXIT_FAILURE),
    }
}

fn show_status(cli: &Cli) -> Result<(), BoxError> {
    let dir = HoldDir::resolve(&cli.device)?;
    let snap = dir.snapshot()?;
    let now = now_ms();
    let secs = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1000.0;
    let holder_json = snap.holder.as_ref().map(|(t, h)| {
        let info = t.info.as_ref();
        serde_json::json!({
            "seq": t.seq,
            "label": info.map(|i| i.label.clone()),
            "pid": info.map(|i| i.pid),
            "uid": info.map(|i| i.uid),
            "child_pid": h.child_pid,
            "command": info.map(|i| i.command.clone()),
            "since": format_utc(h.since_ms),
            "since_ms": h.since_ms,
            "elapsed_s": secs(h.since_ms, now),
            "deadline": h.deadline_ms.map(format_utc),
            "deadline_ms": h.deadline_ms,
            "remaining_s": h.deadline_ms.map(|d| secs(now, d)),
            "state": h.state,
        })
    });
    let queue_json: Vec<serde_json::Value> = snap
        .queue
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let info = t.info.as_ref();
            serde_json::json!({
                "position": i + 1,
                "seq": t.seq,
                "label": info.map(|i| i.label.clone()),
                "pid": info.map(|i| i.pid),
                "uid": info.map(|i| i.uid),
                "command": info.map(|i| i.command.clone()),
                "queued_at": info.map(|i| format_utc(i.queued_at_ms)),
                "waiting_s": info.map(|i| secs(i.queued_at_ms, now)),
                "timeout_s": info.and_then(|i| i.timeout_ms).map(|t| t as f64 / 1000.0),
            })
        })
        .collect();
    if cli.json {
        let doc = serde_json::json!({
            "device": cli.device.display().to_string(),
            "lock_dir": dir.root.display().to_string(),
            "locked": snap.locked,
            "holder": holder_json,
            "queue": queue_json,
        });
        println!("{doc}");
        return Ok(());
    }
    println!(
        "device {} (lock dir {})",
        cli.device.display(),
        dir.root.display()
    );
    match &snap.holder {
        Some((t, h)) => {
            let (label, pid) = t
                .info
                .as_ref()
                .map(|i| (i.label.clone(), i.pid.to_string()))
                .unwrap_or_else(|| ("?".into(), "?".into()));
            let elapsed = Duration::from_millis(now.saturating_sub(h.since_ms));
            let deadline = match h.deadline_ms {
                Some(d) => format!(
                    "deadline {} ({} left)",
                    format_utc(d),
                    format_duration(Duration::from_millis(d.saturating_sub(now)))
                ),
                None => "no deadline".into(),
            };
            println!(
                "holder: '{label}' pid {pid} since {} (elapsed {}), {deadline}, {}",
                format_utc(h.since_ms),
                format_duration(elapsed),
                h.state
            );
        }
        None if snap.locked => println!("holder: locked (holder starting, or outside the queue)"),
        None => println!("holder: none (device free)"),
    }
    if snap.queue.is_empty() {
        println!("queue: empty");
    } else {
        println!("queue ({}):", snap.queue.len());
        for (i, t) in snap.queue.iter().enumerate() {
            match &t.info {
                Some(info) => println!(
                    "  {}. '{}' pid {} waiting {}",
                    i + 1,
                    info.label,
                    info.pid,
                    format_duration(Duration::from_millis(now.saturating_sub(info.queued_at_ms)))
                ),
                None => println!("  {}. ticket {} (unreadable)", i + 1, t.seq),
            }
        }
    }
    Ok(())
}
