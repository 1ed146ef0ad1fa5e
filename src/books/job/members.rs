//! Members: slots and claims, who is alive, and what the dead leave behind.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering;

use cudabudget_spec::job_file as layout;
use cudabudget_spec::place::{self};
use layout::TOMB;

use crate::sys::clock::monotonic_ms;

use super::liveness;
use super::sigbus::*;
use super::words::*;

/// What `/proc/<pid>/stat` says of a process.
#[derive(Clone, Copy, Debug)]
pub(super) struct ProcStat {
    /// Field 3: R, S, D, T, Z, X...
    pub(super) state: u8,
    /// Field 22: clock ticks since boot.
    pub(super) start: u64,
}

pub(super) fn proc_stat(pid: u32) -> Option<ProcStat> {
    let bytes = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&bytes)
}

/// Parses `/proc/<pid>/stat` bytes. The command (field 2) may hold spaces, parentheses
/// and bytes that are not UTF-8 (a name cut to 15 bytes inside a character): the fields
/// are counted from the last `)`, and only they are read (as ASCII).
pub(super) fn parse_stat(bytes: &[u8]) -> Option<ProcStat> {
    let close = bytes.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&bytes[close + 1..]).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start })
}

/// The start time of `pid` (clock ticks since boot).
#[cfg(test)]
pub(super) fn start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|s| s.start)
}

impl Job {
    /// Who holds slot `i`, by its words.
    pub(super) fn holder(&self, i: usize) -> Holder {
        let c = self.claim_at(i);
        let claim = c.claim.load(Ordering::Acquire);
        let start = c.start.load(Ordering::Acquire);
        let fd = c.fd.load(Ordering::Acquire);
        if c.seal.load(Ordering::Acquire) != seal(claim, start, fd) {
            Holder::Garbled
        } else if claim & TOMB == TOMB {
            Holder::Tomb(claim as u32)
        } else if claim == 0 {
            Holder::Free
        } else {
            Holder::Member { claim, start, fd }
        }
    }

    /// Takes a free slot for `pid` (started at `start`): its claim and generation.
    pub(super) fn claim_slot(&self, pid: u32, start: u64) -> Option<(usize, u64)> {
        let fd = self.fd.as_raw_fd() as u32;
        (0..SLOTS).find_map(|i| {
            let c = self.claim_at(i);
            if self.holder(i) != Holder::Free {
                return None;
            }
            // The slot's lock before its claim: a claim whose lock is free is dead.
            let locked = match &self.alive_fd {
                Some(alive) => match liveness::take(alive.as_fd(), i) {
                    liveness::Taken::Yes => true,
                    // Another process is taking this slot (or a child of a dead member
                    // still holds it open): another slot.
                    liveness::Taken::Held => return None,
                    liveness::Taken::Unsupported => false,
                },
                None => false,
            };
            let generation = c
                .generation
                .fetch_add(1, Ordering::AcqRel)
                .wrapping_add(1)
                .max(1);
            let claim = u64::from(pid) | (u64::from(generation) << 32);
            if c.claim
                .compare_exchange(0, claim, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                if let (true, Some(alive)) = (locked, &self.alive_fd) {
                    liveness::release(alive.as_fd(), i);
                }
                return None;
            }
            c.fd.store(fd, Ordering::Release);
            c.start.store(start, Ordering::Release);
            c.seal.store(seal(claim, start, fd), Ordering::Release);
            for d in 0..DEVICES {
                let s = self.share_at(i, d);
                s.used.store(0, Ordering::SeqCst);
                s.inv.store(!0, Ordering::SeqCst);
            }
            Some((i, claim))
        })
    }

    /// Looks for dead processes at most once a second (whoever comes first).
    pub(super) fn maybe_reclaim(&self) {
        let last_scan = self.word64(LAST_SCAN_AT);
        let now = monotonic_ms();
        let last = last_scan.load(Ordering::Relaxed);
        // A time in the future is a stray write: due now.
        if (now.saturating_sub(last) >= SCAN_EVERY_MS || last > now)
            && last_scan
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.reclaim_dead();
        }
    }

    /// Gives back the share of every process of the job that is gone; cleans what a
    /// stray write left in free slots and the queue; checks the file's size.
    pub fn reclaim_dead(&self) {
        // Only while the descriptor is still the ledger (the program may have closed it
        // and its number may be another file now).
        if let Ok(st) = place::fstat(std::os::fd::AsFd::as_fd(&self.fd))
            && (st.st_dev, st.st_ino) == (self.dev, self.ino)
            && st.st_size as usize != FILE_BYTES
        {
            self.mark_damaged(format!("it is {} bytes, not {FILE_BYTES}", st.st_size));
        }
        for i in 0..SLOTS {
            if i == self.slot {
                continue;
            }
            let holder = self.holder(i);
            if !matches!(holder, Holder::Tomb(_) | Holder::Garbled) {
                self.lingering[i].1.store(0, Ordering::Relaxed);
            }
            match holder {
                Holder::Free => self.clean_free_slot(i),
                Holder::Tomb(_) => {
                    // Being taken out of use: finish it if whoever started has not
                    // finished it for SUSPECT_MS (gone or stopped; its pid is not asked:
                    // it may name another process in this PID namespace).
                    let claim = self.claim_at(i).claim.load(Ordering::Acquire);
                    if self.lingered(i, claim) {
                        self.free_slot(i, claim);
                    }
                }
                Holder::Member { claim, start, fd } => {
                    if !self.alive(i, claim as u32, start, fd) {
                        self.free_slot(i, claim);
                    }
                }
                // Left counted (fail closed) while its claim's process lives: its owner
                // restores it at its next call. A process that died between its claim
                // and its seal (or a tombstone never finished) is cleaned after
                // SUSPECT_MS.
                Holder::Garbled => {
                    let c = self.claim_at(i);
                    let claim = c.claim.load(Ordering::Acquire);
                    let start = c.start.load(Ordering::Acquire);
                    let gone = claim & TOMB == TOMB
                        || (self.lock_held(i) != Some(true) && {
                            let pid = claim as u32;
                            pid == 0
                                || match proc_stat(pid) {
                                    None => !pid_exists(pid),
                                    Some(st) => {
                                        matches!(st.state, b'Z' | b'X')
                                            || (start != 0 && st.start != start)
                                    }
                                }
                        });
                    if !gone {
                        self.lingering[i].1.store(0, Ordering::Relaxed);
                    } else if self.lingered(i, claim) {
                        self.free_slot(i, claim);
                    }
                }
            }
        }
        for w in 0..WAITERS {
            let e = self.waiter(w);
            let ticket = e.ticket.load(Ordering::Acquire);
            if ticket == 0 {
                continue;
            }
            let slot = e.slot.load(Ordering::Acquire) as usize;
            let claim = e.claim.load(Ordering::Acquire);
            if slot >= SLOTS || self.claim_at(slot).claim.load(Ordering::Acquire) != claim {
                let _ = e
                    .ticket
                    .compare_exchange(ticket, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// Whether this process has seen claim `claim` linger in slot `i` (garbled, or a
    /// tombstone) for [`SUSPECT_MS`]; starts the count when it is new.
    pub(super) fn lingered(&self, i: usize, claim: u64) -> bool {
        let (seen, since) = &self.lingering[i];
        let now = monotonic_ms().max(1);
        if seen.swap(claim, Ordering::Relaxed) != claim || since.load(Ordering::Relaxed) == 0 {
            since.store(now, Ordering::Relaxed);
            return false;
        }
        now.saturating_sub(since.load(Ordering::Relaxed)) >= SUSPECT_MS
    }

    /// A free slot must hold (0, !0) on every device; anything else (a stray write)
    /// counts against the job (fail closed). It may also be a live member whose claim a
    /// stray write wiped, which restores its slot at its next call: so it is cleaned only
    /// once this process has seen it so for [`SUSPECT_MS`].
    pub(super) fn clean_free_slot(&self, i: usize) {
        let garbage = (0..DEVICES).any(|d| {
            let s = self.share_at(i, d);
            (s.used.load(Ordering::SeqCst), s.inv.load(Ordering::SeqCst)) != (0, !0)
        });
        let suspect = &self.suspects[i];
        if !garbage {
            suspect.store(0, Ordering::Relaxed);
            return;
        }
        let now = monotonic_ms().max(1);
        let since = suspect.load(Ordering::Relaxed);
        if since == 0 {
            suspect.store(now, Ordering::Relaxed);
            return;
        }
        if now.saturating_sub(since) < SUSPECT_MS {
            return;
        }
        suspect.store(0, Ordering::Relaxed);
        for d in 0..DEVICES {
            let s = self.share_at(i, d);
            let (used, inv) = (s.used.load(Ordering::SeqCst), s.inv.load(Ordering::SeqCst));
            if (used, inv) != (0, !0) && self.claim_at(i).claim.load(Ordering::SeqCst) == 0 {
                let _ = s
                    .used
                    .compare_exchange(used, 0, Ordering::SeqCst, Ordering::Relaxed);
                let _ = s
                    .inv
                    .compare_exchange(inv, !0, Ordering::SeqCst, Ordering::Relaxed);
                self.wake(d);
            }
        }
    }

    /// Takes slot `i` (claim `claim`) out of use: its shares go back, it is free again.
    /// A tombstone first, so that only one process cleans it and never a new owner's.
    pub(super) fn free_slot(&self, i: usize, claim: u64) {
        let c = self.claim_at(i);
        let tomb = TOMB | u64::from(std::process::id());
        let (start, fd) = (
            c.start.load(Ordering::Acquire),
            c.fd.load(Ordering::Acquire),
        );
        if c.claim
            .compare_exchange(claim, tomb, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        c.seal.store(seal(tomb, start, fd), Ordering::Release);
        let mut freed = [false; DEVICES];
        for (d, freed) in freed.iter_mut().enumerate() {
            let s = self.share_at(i, d);
            *freed = s.used.load(Ordering::Relaxed) != 0 || s.inv.load(Ordering::Relaxed) != !0;
            s.used.store(0, Ordering::SeqCst);
            s.inv.store(!0, Ordering::SeqCst);
        }
        c.start.store(0, Ordering::Release);
        c.fd.store(0, Ordering::Release);
        c.claim.store(0, Ordering::Release);
        c.seal.store(!0, Ordering::Release);
        for (d, freed) in freed.into_iter().enumerate() {
            if freed {
                self.wake(d);
            }
        }
    }

    /// Whether the member `pid` (started at `start`, keeping the ledger open as `fd`)
    /// is still the process that joined: not gone, not another process with its pid, not
    /// a zombie, and not another program (exec) — it still has the ledger open or mapped.
    pub(super) fn alive(&self, slot: usize, pid: u32, start: u64, fd: u32) -> bool {
        if pid == 0 {
            return false;
        }
        if self.lock_held(slot) == Some(true) {
            return true;
        }
        let Some(stat) = proc_stat(pid) else {
            // No /proc entry: gone (or /proc hides it: ask the kernel).
            return pid_exists(pid) && std::fs::metadata("/proc/self").is_err();
        };
        if matches!(stat.state, b'Z' | b'X') {
            return false;
        }
        if start == 0 {
            // Joining: its start time is not written yet.
            return true;
        }
        if stat.start != start {
            return false;
        }
        // Exec'd? The descriptor it keeps (close-on-exec) is the ledger...
        if let Ok(m) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) {
            use std::os::unix::fs::MetadataExt;
            if m.dev() == self.dev && m.ino() == self.ino {
                return true;
            }
        }
        // ... or, if it closed it, the file is still mapped.
        // (Bytes: a mapped file's name need not be UTF-8.)
        match std::fs::read(format!("/proc/{pid}/maps")) {
            Ok(maps) => maps_ledger(&String::from_utf8_lossy(&maps), self.dev, self.ino),
            // Cannot look (another user's, not dumpable): alive.
            Err(_) => true,
        }
    }

    /// Whether slot `i`'s [`liveness`] lock is held by some open of the ledger other than
    /// the one asked through (`None`: this file system has no such locks). Asked through
    /// our main descriptor, or our lock's when the program closed the main one; with
    /// neither still the ledger, `Some(true)`: a process that cannot ask judges nobody
    /// dead (fail closed; the job's other members still can).
    pub(super) fn lock_held(&self, i: usize) -> Option<bool> {
        if self.is_still_the_ledger() {
            return liveness::held(self.fd.as_fd(), i);
        }
        match &self.alive_fd {
            Some(alive) if is_file(alive.as_raw_fd() as u32, self.dev, self.ino) => {
                liveness::held(alive.as_fd(), i)
            }
            _ => Some(true),
        }
    }

    /// The process is leaving (exit): its share goes back, its slot is free.
    pub fn leave(&self) {
        let _w = self.writing.lock();
        // Only while the slot holds our claim (leave may run twice, and the slot may be a
        // newcomer's by then, its claim half written).
        if self.claim == 0 || self.claim_at(self.slot).claim.load(Ordering::Acquire) != self.claim {
            return;
        }
        for d in 0..DEVICES {
            if self.mine[d].swap(0, Ordering::AcqRel) != 0 {
                let s = self.share_at(self.slot, d);
                s.used.store(0, Ordering::SeqCst);
                s.inv.store(!0, Ordering::SeqCst);
                self.wake(d);
            }
        }
        // Through a tombstone (compare-exchange from our claim), as any slot is freed;
        // then the slot's lock (a claim without its lock is dead, never the reverse).
        self.free_slot(self.slot, self.claim);
        if let Some(alive) = &self.alive_fd {
            liveness::release(alive.as_fd(), self.slot);
        }
        if let Some(i) = self.mapping {
            MAPPED[i].slot.store(0, Ordering::Release);
        }
        self.remove_if_last();
    }

    /// The job's largest holders on `device`: up to five `(pid, bytes)`, largest first
    /// (`(0, 0)` past the end). No allocation: for the denial events.
    pub fn top_holders(&self, device: usize) -> [(u32, u64); 5] {
        let mut top = [(0u32, 0u64); 5];
        for i in 0..SLOTS {
            let claim = self.claim_at(i).claim.load(Ordering::Acquire);
            let used = self.share_of(i, device);
            if claim == 0 || claim & TOMB == TOMB || used == 0 || used <= top[4].1 {
                continue;
            }
            top[4] = (claim as u32, used);
            top.sort_by_key(|h| std::cmp::Reverse(h.1));
        }
        top
    }

    /// Processes in the job now (claimed slots), for the tests.
    #[cfg(test)]
    pub fn members(&self) -> usize {
        layout::Words::members(self)
    }
}

/// Whether `/proc/<pid>/maps` text maps the file (`dev`, `ino`).
pub(super) fn maps_ledger(maps: &str, dev: u64, ino: u64) -> bool {
    let want_dev = format!("{:02x}:{:02x}", libc::major(dev), libc::minor(dev));
    let want_ino = ino.to_string();
    maps.lines().any(|line| {
        let mut f = line.split_ascii_whitespace();
        f.nth(3) == Some(want_dev.as_str()) && f.next() == Some(want_ino.as_str())
    })
}

pub(super) fn pid_exists(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}
