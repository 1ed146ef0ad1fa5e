//! The layout of a job's ledger file (`CUDABUDGET_SCOPE=job:<name>`), shared by the
//! library (which maps it) and `cudabudget doctor` (which names a damaged one).
//!
//! | offset | what |
//! |---|---|
//! | 0 | header: magic, version, slot / device / waiter counts, size, checksum |
//! | 64 | when a member last looked for dead ones (ms, CLOCK_MONOTONIC) |
//! | 72 | [`BUDGET_GENERATION_AT`]: bumped at each change of the job's budget |
//! | 80 | [`BUDGET_BY_AT`]: who made the last change: uid (high 32 bits), pid (low 32) |
//! | 128 | per device: admission lock word, next ticket, wake word, waiter count |
//! | [`BUDGETS_AT`] | per device: the job's budget ([`encode_budget`]) and its complement |
//! | [`WAITERS_AT`] | [`WAITERS`] waiting threads: ticket, claim of their slot, device, heartbeat |
//! | [`CLAIMS_AT`] | per slot: claim (pid and generation), start time, descriptor |
//! | [`SHARES_AT`] | per device, per slot: what the slot holds, and its complement |
//!
//! Everything but the header's first 40 bytes changes while the job runs; those 40 are
//! written once, before the file gets its name, and checked by every reader.

use crate::record::MAX_DEVICES;

/// "CBJOBv02": a cudabudget job ledger of layout 2.
pub const MAGIC: u64 = u64::from_le_bytes(*b"CBJOBv02");
pub const VERSION: u32 = 2;
/// Processes a job holds at once.
pub const SLOTS: usize = 1024;
pub const DEVICES: usize = MAX_DEVICES;
/// Threads of the job that can wait in the queue at once.
pub const WAITERS: usize = 256;

pub const HEADER_BYTES: usize = 40;
pub const DEVICE_WORDS_AT: usize = 128;
pub const DEVICE_WORD_BYTES: usize = 32;
pub const WAITERS_AT: usize = 4096;
pub const WAITER_BYTES: usize = 32;
pub const CLAIMS_AT: usize = WAITERS_AT + WAITERS * WAITER_BYTES;
pub const CLAIM_BYTES: usize = 32;
pub const SHARES_AT: usize = CLAIMS_AT + SLOTS * CLAIM_BYTES;
/// A slot's share on one device: what it holds, then the bitwise complement of that.
pub const SHARE_BYTES: usize = 16;
pub const FILE_BYTES: usize = SHARES_AT + DEVICES * SLOTS * SHARE_BYTES;

/// Bumped (by one) at each change of the job's budget on any device.
pub const BUDGET_GENERATION_AT: usize = 72;
/// Who made the last change: uid in the high 32 bits, pid in the low 32.
pub const BUDGET_BY_AT: usize = 80;
/// Offset of a device's wake word in its [`DEVICE_WORD_BYTES`] (a futex word: waiters
/// sleep on it, every free bumps it).
pub const WAKE_IN_DEVICE_WORD: usize = 16;
/// Per device, the job's budget: [`encode_budget`]'s word, then its bitwise complement
/// (a stray write sets or raises it only by writing both consistently: [`decode_budget`]).
pub const BUDGETS_AT: usize = DEVICE_WORDS_AT + DEVICES * DEVICE_WORD_BYTES;
pub const BUDGET_BYTES: usize = 16;

const _: () = assert!(BUDGETS_AT + DEVICES * BUDGET_BYTES <= WAITERS_AT);

/// A claim being taken out of use: the high half all ones, the low half the pid of the
/// process doing it.
pub const TOMB: u64 = 0xFFFF_FFFF_0000_0000;

/// Whether a slot's claim word names a member (neither free nor a tombstone).
pub fn is_member(claim: u64) -> bool {
    claim != 0 && claim & TOMB != TOMB
}

/// A ledger's words, however they are reached: the library's mapping (atomic loads) or
/// the command line's copy of its bytes. What the words mean is read here, once, for
/// both: a budget from its two words, a share as the larger of its two, the job's use as
/// their sum.
pub trait Words {
    /// The little-endian word at `at` (a multiple of 8 inside the file).
    fn word64(&self, at: usize) -> u64;

    /// The job's budget on `device` ([`decode_budget`]).
    fn budget(&self, device: usize) -> Option<u64> {
        let at = budget_at(device);
        decode_budget(self.word64(at), self.word64(at + 8))
    }

    /// Slot `slot`'s share on `device` ([`share_value`]).
    fn share(&self, slot: usize, device: usize) -> u64 {
        let at = share_at(slot, device);
        share_value(self.word64(at), self.word64(at + 8))
    }

    /// What the job holds on `device`: the sum of the slots' shares.
    fn used(&self, device: usize) -> u64 {
        (0..SLOTS)
            .map(|slot| self.share(slot, device))
            .fold(0u64, u64::saturating_add)
    }

    /// The slots a member holds.
    fn members(&self) -> usize {
        (0..SLOTS)
            .filter(|&slot| is_member(self.word64(claim_at(slot))))
            .count()
    }
}

/// Where slot `slot`'s claim lies.
pub fn claim_at(slot: usize) -> usize {
    CLAIMS_AT + slot * CLAIM_BYTES
}

/// Where slot `slot`'s share of `device` lies (what it holds, then the complement).
pub fn share_at(slot: usize, device: usize) -> usize {
    SHARES_AT + (device * SLOTS + slot) * SHARE_BYTES
}

/// A share read from its two words: the larger of what it holds and the complement's
/// complement, so that a stray write lowers it only by writing both consistently.
pub fn share_value(used: u64, complement: u64) -> u64 {
    used.max(!complement)
}

/// Where `device`'s admission words lie.
pub fn device_words_at(device: usize) -> usize {
    DEVICE_WORDS_AT + device * DEVICE_WORD_BYTES
}

/// Where `device`'s budget words lie ([`encode_budget`], then its complement).
pub fn budget_at(device: usize) -> usize {
    BUDGETS_AT + device * BUDGET_BYTES
}

/// The word that says "the job's budget is `bytes`" (0 says none is set).
pub fn encode_budget(bytes: u64) -> u64 {
    bytes.min(u64::MAX - 2) + 1
}

/// The job's budget from a device's two budget words: `None` while none is set, and
/// while the two disagree (mid-write, or after a stray write): then each member's own
/// budget counts, so that a stray write never sets or raises the job's.
pub fn decode_budget(word: u64, complement: u64) -> Option<u64> {
    if word != !complement {
        return None;
    }
    word.checked_sub(1)
}

/// FNV-1a (64-bit) over the little-endian magic, version, slot, device and waiter
/// counts and size: what tells a foreign or damaged file from ours.
pub fn checksum(
    magic: u64,
    version: u32,
    slots: u32,
    devices: u32,
    waiters: u32,
    size: u64,
) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in magic
        .to_le_bytes()
        .into_iter()
        .chain(version.to_le_bytes())
        .chain(slots.to_le_bytes())
        .chain(devices.to_le_bytes())
        .chain(waiters.to_le_bytes())
        .chain(size.to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The header this build writes.
pub fn header() -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(DEVICES as u32).to_le_bytes());
    h[20..24].copy_from_slice(&(WAITERS as u32).to_le_bytes());
    h[24..32].copy_from_slice(&(FILE_BYTES as u64).to_le_bytes());
    let check = checksum(
        MAGIC,
        VERSION,
        SLOTS as u32,
        DEVICES as u32,
        WAITERS as u32,
        FILE_BYTES as u64,
    );
    h[32..40].copy_from_slice(&check.to_le_bytes());
    h
}

/// What is wrong with a ledger whose first bytes are `head` and whose file is `len`
/// bytes long, in words; `None` when it is a ledger of this build's layout.
pub fn problem(head: &[u8], len: u64) -> Option<String> {
    if len != FILE_BYTES as u64 {
        return Some(format!(
            "it is {len} bytes, not the {FILE_BYTES} of this build's layout (truncated, \
             grown, another version's or damaged)"
        ));
    }
    let Some(head) = head.get(..HEADER_BYTES) else {
        return Some("its header cannot be read".to_string());
    };
    let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes"));
    let (magic, version) = (u64_at(0), u32_at(8));
    let (slots, devices, waiters, size, check) =
        (u32_at(12), u32_at(16), u32_at(20), u64_at(24), u64_at(32));
    if magic != MAGIC {
        Some("it is not a cudabudget job ledger of this layout (bad magic)".to_string())
    } else if version != VERSION {
        Some(format!(
            "it has layout version {version}, this build reads {VERSION}"
        ))
    } else if check != checksum(magic, version, slots, devices, waiters, size) {
        Some("its header checksum is wrong (damaged)".to_string())
    } else if slots as usize != SLOTS
        || devices as usize != DEVICES
        || waiters as usize != WAITERS
        || size != FILE_BYTES as u64
    {
        Some("its header does not match this build's layout".to_string())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_job_budget_reads_back_only_when_both_words_agree() {
        assert_eq!(decode_budget(0, 0), None, "a new file");
        let w = encode_budget(20 << 30);
        assert_eq!(decode_budget(w, !w), Some(20 << 30));
        assert_eq!(decode_budget(w, 0), None, "mid-write");
        assert_eq!(decode_budget(0, !w), None, "the word wiped");
        assert_eq!(
            decode_budget(encode_budget(40 << 30), !w),
            None,
            "a stray raise"
        );
        assert_eq!(decode_budget(encode_budget(0), !encode_budget(0)), Some(0));
    }

    use super::*;

    #[test]
    fn this_builds_header_is_a_ledger_and_any_changed_byte_is_not() {
        let h = header();
        assert_eq!(problem(&h, FILE_BYTES as u64), None);
        for i in 0..HEADER_BYTES {
            let mut bad = h;
            bad[i] ^= 0x01;
            assert!(problem(&bad, FILE_BYTES as u64).is_some(), "byte {i}");
        }
        assert!(problem(&h, 0).unwrap().contains("0 bytes"));
        assert!(problem(&h[..10], FILE_BYTES as u64).is_some());
    }

    /// A ledger takes less than two MiB (checked when the tests compile).
    const _: () = assert!(FILE_BYTES < 2 << 20);
}
