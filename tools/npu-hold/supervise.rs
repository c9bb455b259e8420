//! Running the command in its own process group and making sure nothing of it survives.
//!
//! `npu-hold` is a child subreaper, so orphans of the command (double forks, `setsid` escapees)
//! are re-parented to it. Stopping the command therefore means: signal the process group and
//! every process descending from `npu-hold` (found in `/proc`), reap, repeat until none is left.
//!
//! If `npu-hold` itself is SIGKILLed, nothing of it runs: the command dies by its parent-death
//! signal, and a [`Watchdog`] (npu-hold re-run with `--watch-group`, in its own process group,
//! reading a pipe only npu-hold writes) sees the pipe close without a word and SIGKILLs the
//! command's process group, so the command's own children die too.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Signals that make `npu-hold` stop the command (and leave the queue).
pub const STOP_SIGNALS: [Signal; 4] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
];

/// The stop signals and SIGCHLD, blocked in this thread and taken synchronously.
pub struct Signals {
    set: SigSet,
}

impl Signals {
    /// Block the signals `npu-hold` handles. Call before any other thread exists. A stop signal
    /// that is ignored on entry (`nohup`, a background job of a non-interactive shell) stays
    /// ignored and is not handled, as a shell would do. The command starts with an empty mask.
    pub fn block() -> nix::Result<Signals> {
        let mut set = SigSet::empty();
        for s in STOP_SIGNALS {
            if ignored_on_entry(s) {
                tracing::debug!("{s} is ignored on entry: leaving it ignored");
            } else {
                set.add(s);
            }
        }
        set.add(Signal::SIGCHLD);
        let mut mask = set;
        // Blocked but never waited for: lets tcsetpgrp work after the command took the terminal.
        mask.add(Signal::SIGTTOU);
        mask.thread_block()?;
        Ok(Signals { set })
    }

    /// Wait up to `timeout` for one of the blocked signals (SIGCHLD included).
    pub fn wait(&self, timeout: Duration) -> Option<Signal> {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            // < 1e9: fits a c_long everywhere.
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `self.set` is an initialised sigset_t owned by `self`, a null siginfo pointer is
        // allowed by sigtimedwait(2), and `ts` outlives the call.
        let r = unsafe { libc::sigtimedwait(self.set.as_ref(), std::ptr::null_mut(), &ts) };
        if r > 0 {
            Signal::try_from(r).ok()
        } else {
            None // timeout (EAGAIN) or EINTR
        }
    }
}

/// Whether `sig`'s disposition is SIG_IGN.
fn ignored_on_entry(sig: Signal) -> bool {
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a null new action only queries the current one into `old`, a valid, writable
    // sigaction buffer (zero-initialised, so it is fully initialised even if the call fails).
    let rc = unsafe { libc::sigaction(sig as libc::c_int, std::ptr::null(), old.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    // SAFETY: zero-initialised above and filled in by sigaction on success.
    let old = unsafe { old.assume_init() };
    old.sa_sigaction == libc::SIG_IGN
}

/// Whether stdin is a terminal whose foreground process group is ours: then the command gets the
/// terminal (so it can read it and receives Ctrl-C itself) and gets it back at the end.
pub fn stdin_is_our_terminal() -> bool {
    let stdin = std::io::stdin();
    std::io::IsTerminal::is_terminal(&stdin)
        && nix::unistd::tcgetpgrp(&stdin).ok() == Some(nix::unistd::getpgrp())
}

/// Give the terminal on stdin back to npu-hold's process group.
pub fn restore_terminal() {
    let _ = nix::unistd::tcsetpgrp(std::io::stdin(), nix::unistd::getpgrp());
}

/// Start `argv` in a new process group (its pgid is its pid), dying with `npu-hold`. With
/// `foreground`, the new group becomes the foreground group of the terminal on stdin.
pub fn spawn(argv: &[OsString], env: &[(&str, String)], foreground: bool) -> io::Result<Pid> {
    let Some((program, args)) = argv.split_first() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty command"));
    };
    let mut cmd = Command::new(program);
    cmd.args(args).process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let parent = nix::unistd::getpid().as_raw();
    let hook = move || -> io::Result<()> {
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes no pointers; it is a plain syscall, safe between
        // fork and exec. If npu-hold is SIGKILLed, the kernel then kills the command.
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        if foreground {
            // SAFETY: setpgid, getpid and tcsetpgrp take no pointers and are async-signal-safe.
            // SIGTTOU is still blocked here (inherited), so tcsetpgrp from the new, background
            // group succeeds. Errors are ignored: the parent makes the same call.
            unsafe {
                libc::setpgid(0, 0);
                libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpid());
            }
        }
        // Start the command with no blocked signals (npu-hold blocks its stop signals and SIGCHLD).
        let mut empty = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
        // SAFETY: `empty` is a writable sigset_t; sigemptyset and sigprocmask are
        // async-signal-safe and only touch it and the calling thread's mask.
        let rc = unsafe {
            libc::sigemptyset(empty.as_mut_ptr());
            libc::sigprocmask(libc::SIG_SETMASK, empty.as_ptr(), std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: getppid(2) has no arguments and cannot fail.
        if unsafe { libc::getppid() } != parent {
            // npu-hold died before the death signal was armed.
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: `hook` runs in the forked child before exec; it only makes async-signal-safe
    // syscalls (prctl, setpgid, tcsetpgrp, sigprocmask, getppid) and does not allocate or take
    // locks.
    unsafe {
        cmd.pre_exec(hook);
    }
    let child = cmd.spawn()?;
    let pid = i32::try_from(child.id())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "child pid out of range"))?;
    if foreground {
        // Same call as in the child, whichever runs first (as shells do).
        let _ = nix::unistd::tcsetpgrp(std::io::stdin(), Pid::from_raw(pid));
    }
    // `child` is dropped without waiting: this module reaps with waitpid(-1).
    Ok(Pid::from_raw(pid))
}

/// The process that kills the command's group if npu-hold dies without standing it down.
pub struct Watchdog {
    pid: Pid,
    /// Closed without a word (npu-hold died): the watchdog kills the group.
    pipe: Option<std::process::ChildStdin>,
}

impl Watchdog {
    /// Start `npu-hold --watch-group PGID` (this executable) for the group `pgid`.
    pub fn start(pgid: Pid) -> io::Result<Watchdog> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("--watch-group")
            .arg(pgid.as_raw().to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            // Out of the terminal's signals: it must outlive an npu-hold that Ctrl-C stops.
            .process_group(0)
            .spawn()?;
        let pid = i32::try_from(child.id())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "watchdog pid out of range"))?;
        Ok(Watchdog {
            pid: Pid::from_raw(pid),
            pipe: child.stdin.take(),
        })
    }

    /// Its pid (not one of the command's processes).
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Tell it the group is handled and let it exit (it is reaped by [`Run::reap`]).
    pub fn stand_down(mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = pipe.write_all(b"done\n");
        }
    }
}

/// `npu-hold --watch-group PGID`: wait on stdin; at end of file with nothing read (npu-hold died)
/// SIGKILL the group; when told, exit without touching it. Returns the exit code.
pub fn watch_group(pgid: i32) -> i32 {
    use std::io::Read;
    let mut byte = [0u8; 1];
    loop {
        match io::stdin().read(&mut byte) {
            Ok(0) => {
                if pgid > 1 {
                    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
                }
                return 0;
            }
            Ok(_) => return 0,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return 1,
        }
    }
}

/// How often [`Run::wait`] samples (device error counters).
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Why the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The command exited by itself.
    Exited,
    /// The time limit was reached.
    Timeout,
    /// npu-hold received a stop signal.
    Signal(Signal),
}

/// What stopping the process tree took.
#[derive(Debug, Default)]
pub struct Cleanup {
    /// Distinct processes that were still alive and got signalled.
    pub signalled: usize,
    /// SIGKILL was needed (grace expired or a second stop signal arrived).
    pub escalated: bool,
}

/// A running command: its pid (= pgid) and, once reaped, its wait status.
pub struct Run {
    pub child: Pid,
    pub status: Option<WaitStatus>,
    told_stopped: bool,
    /// npu-hold's own helper (the watchdog): a child, but not part of the command.
    helper: Option<Pid>,
}

impl Run {
    pub fn new(child: Pid, helper: Option<Pid>) -> Run {
        Run {
            child,
            status: None,
            told_stopped: false,
            helper,
        }
    }

    /// Reap every exited child: the command, and orphans re-parented to us as subreaper.
    pub fn reap(&mut self) {
        loop {
            match waitpid(
                None::<Pid>,
                Some(WaitPidFlag::WNOHANG | WaitPidFlag::WUNTRACED),
            ) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(WaitStatus::Stopped(pid, sig)) => self.stopped(pid, sig),
                Ok(ws) => {
                    if ws.pid() == Some(self.child)
                        && matches!(ws, WaitStatus::Exited(..) | WaitStatus::Signaled(..))
                    {
                        self.status = Some(ws);
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(_) => break, // ECHILD: nothing left to reap
            }
        }
    }

    /// A process of ours was stopped. A suspended held run would keep the device for nothing, so
    /// Ctrl-Z (SIGTSTP) and SIGSTOP are undone; a stop on terminal I/O (SIGTTIN/SIGTTOU: npu-hold
    /// runs in the background) is left alone, or resuming it would spin.
    fn stopped(&mut self, pid: Pid, sig: Signal) {
        let resume = matches!(sig, Signal::SIGTSTP | Signal::SIGSTOP);
        if !self.told_stopped {
            self.told_stopped = true;
            let mut err = io::stderr();
            let _ = if resume {
                writeln!(err, "npu-hold: {sig} stopped process {pid}; a held run cannot be suspended: resumed (stop it with Ctrl-C)")
            } else {
                writeln!(err, "npu-hold: process {pid} stopped by {sig} (terminal I/O while npu-hold is in the background)")
            };
        }
        if resume {
            let _ = kill(pid, Signal::SIGCONT);
            if !matches!(killpg(self.child, None), Err(Errno::ESRCH)) {
                let _ = killpg(self.child, Signal::SIGCONT);
            }
        }
    }

    /// Wait until the command exits, the deadline passes, or a stop signal arrives. `sample`
    /// runs about once a second meanwhile.
    pub fn wait(
        &mut self,
        signals: &Signals,
        deadline: Option<Instant>,
        mut sample: impl FnMut(),
    ) -> Ending {
        let mut next_sample = Instant::now() + SAMPLE_EVERY;
        loop {
            if Instant::now() >= next_sample {
                sample();
                next_sample = Instant::now() + SAMPLE_EVERY;
            }
            self.reap();
            if self.status.is_some() {
                return Ending::Exited;
            }
            let mut tick = Duration::from_millis(200);
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    return Ending::Timeout;
                }
                tick = tick.min(d - now);
            }
            match signals.wait(tick) {
                Some(Signal::SIGCHLD) | None => {}
                Some(s) => return Ending::Signal(s),
            }
        }
    }

    /// Stop the command's process group and every descendant of npu-hold: SIGTERM (+SIGCONT),
    /// SIGKILL after `grace` (or at once on another stop signal), and return only when no
    /// process of the group and no descendant is left, all reaped.
    pub fn stop_all(&mut self, signals: &Signals, grace: Duration) -> Cleanup {
        let me = nix::unistd::getpid().as_raw();
        let pgid = self.child;
        let grace_end = Instant::now() + grace;
        let mut cleanup = Cleanup::default();
        let mut termed: HashSet<i32> = HashSet::new();
        let mut group_termed = false;
        let mut last_note = Instant::now();
        loop {
            self.reap();
            let group_alive = !matches!(killpg(pgid, None), Err(Errno::ESRCH));
            let mut descendants = descendants_of(me);
            descendants.retain(|p| Some(p.pid) != self.helper.map(Pid::as_raw));
            if !group_alive && descendants.is_empty() {
                break;
            }
            if !cleanup.escalated && Instant::now() >= grace_end {
                cleanup.escalated = true;
            }
            let outside_group = descendants.iter().filter(|p| p.pgrp != pgid.as_raw());
            if cleanup.escalated {
                if group_alive {
                    let _ = killpg(pgid, Signal::SIGKILL);
                }
                for p in outside_group {
                    let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
                }
            } else {
                if group_alive && !group_termed {
                    let _ = killpg(pgid, Signal::SIGTERM);
                    let _ = killpg(pgid, Signal::SIGCONT);
                    group_termed = true;
                }
                for p in outside_group {
                    if termed.insert(p.pid) {
                        let _ = kill(Pid::from_raw(p.pid), Signal::SIGTERM);
                        let _ = kill(Pid::from_raw(p.pid), Signal::SIGCONT);
                    }
                }
            }
            for p in &descendants {
                termed.insert(p.pid);
            }
            cleanup.signalled = termed.len();
            if cleanup.escalated && last_note.elapsed() >= Duration::from_secs(5) {
                let pids: Vec<String> = descendants.iter().map(|p| p.pid.to_string()).collect();
                tracing::warn!(
                    "still waiting for processes to die after SIGKILL (uninterruptible?): {}",
                    pids.join(" ")
                );
                last_note = Instant::now();
            }
            match signals.wait(Duration::from_millis(20)) {
                Some(Signal::SIGCHLD) | None => {}
                Some(s) => {
                    if !cleanup.escalated {
                        tracing::info!("{s} while stopping: escalating to SIGKILL now");
                        cleanup.escalated = true;
                    }
                }
            }
        }
        cleanup
    }
}

/// Exit code of a wait status, shell style: the exit code, or 128 + the signal number.
pub fn exit_code(status: &WaitStatus) -> Option<i32> {
    match status {
        WaitStatus::Exited(_, code) => Some(*code),
        WaitStatus::Signaled(_, sig, _) => Some(128 + *sig as i32),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy)]
struct ProcEntry {
    pid: i32,
    pgrp: i32,
}

/// Every process below `root` in the process tree (per /proc), zombies included.
fn descendants_of(root: i32) -> Vec<ProcEntry> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        tracing::debug!("/proc unreadable: only the process group is tracked");
        return Vec::new();
    };
    let mut children: HashMap<i32, Vec<ProcEntry>> = HashMap::new();
    for entry in dir.filter_map(|e| e.ok()) {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue; // exited meanwhile
        };
        // "pid (comm) state ppid pgrp ...": comm may contain anything, so split after the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut fields = rest.split_whitespace().skip(1);
        let ppid = fields.next().and_then(|f| f.parse::<i32>().ok());
        let pgrp = fields.next().and_then(|f| f.parse::<i32>().ok());
        if let (Some(ppid), Some(pgrp)) = (ppid, pgrp) {
            children
                .entry(ppid)
                .or_default()
                .push(ProcEntry { pid, pgrp });
        }
    }
    let mut out = Vec::new();
    let mut visited = HashSet::from([root]);
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Some(kids) = children.get(&p) {
            for k in kids {
                // `visited` guards against a torn /proc snapshot (pid reuse) forming a cycle.
                if visited.insert(k.pid) {
                    out.push(*k);
                    stack.push(k.pid);
                }
            }
        }
    }
    out
}
