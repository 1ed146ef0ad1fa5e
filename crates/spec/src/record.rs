//! The layout of a process's published record: what `cudabudget status` and the exporter
//! read, and what the library's publisher writes.
//!
//! Pure: bytes in, bytes out.
//!
//! A record is one file of [`SIZE`] bytes, little-endian, fixed offsets:
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `b"CUDABREC"` |
//! | 8 | version (u32) = [`VERSION`] |
//! | 12 | size (u32) = [`SIZE`] |
//! | 16 | checksum (u64): FNV-1a of the whole record with these 8 bytes zero |
//! | 24 | pid (u32) |
//! | 28 | device count (u32, at most [`MAX_DEVICES`]) |
//! | 32 | start time of the process (u64, clock ticks since boot: `/proc/<pid>/stat` field 22) |
//! | 40 | PID namespace (u64, the inode of `/proc/self/ns/pid`; 0 unknown) |
//! | 48 | updated (u64, milliseconds since the Unix epoch) |
//! | 56 | sequence (u64, one more at every write) |
//! | 64 | string lengths (u16 each): job, command, pod, namespace, container; `u16::MAX` = absent |
//! | 96 | strings, each in its own fixed field (see [`FIELDS`]) |
//! | 1760 | devices, [`DEVICE_SIZE`] bytes each: ordinal (u32), flags (u32, bit 0: UUID known), budget, used, peak, denials, waits (u64 each), UUID (48 bytes) |
//! | 7904 | overruns (`CUDABUDGET_ON_EXCEED=warn`), one u32 per device in the devices' order, stopping at `u32::MAX` |
//!
//! The overruns sit in what was the record's padding: a library that predates them
//! wrote zeros there (no overrun), and a reader that predates them never looks.
//!
//! Readers treat a record as untrusted: every length and count is checked against the
//! layout, the checksum against the contents, every figure against [`MAX_FIGURE`] and
//! every ordinal against [`MAX_DEVICES`]; text is taken as lossy UTF-8 (and escaped by
//! whoever shows it on a terminal). The writer replaces the file whole (a temporary file
//! renamed over it), so a reader never meets a half-written record: one that fails the
//! checksum is damaged or forged (a reader looks once more, at once, for an older
//! library that wrote in place).

use std::fmt;

pub const MAGIC: [u8; 8] = *b"CUDABREC";
pub const VERSION: u32 = 1;
/// The size of every record file.
pub const SIZE: usize = 8192;
/// Devices a record can hold: the library budgets ordinals 0..=63.
pub const MAX_DEVICES: usize = 64;
pub const DEVICE_SIZE: usize = 96;
const UUID_LEN: usize = 48;
const LENGTHS: usize = 64;
const STRINGS: usize = 96;
const DEVICES: usize = 1760;
const OVERRUNS: usize = DEVICES + MAX_DEVICES * DEVICE_SIZE;
const ABSENT: u16 = u16::MAX;
/// The largest figure (bytes or a count) a record may carry: 2^53, 8 PiB, more than any
/// card holds and the largest integer a float (Prometheus' samples, JSON readers) keeps
/// exactly. The writer clamps to it; a reader refuses a record above it (forged).
pub const MAX_FIGURE: u64 = 1 << 53;

/// The text fields, in their order, with their capacity in bytes (longer text is cut at
/// a character boundary).
pub const FIELDS: [(&str, usize); 5] = [
    ("job", 128),
    ("command", 1024),
    ("pod", 256),
    ("namespace", 128),
    ("container", 128),
];

const _: () = {
    let mut end = STRINGS;
    let mut i = 0;
    while i < FIELDS.len() {
        end += FIELDS[i].1;
        i += 1;
    }
    assert!(end <= DEVICES);
    assert!(OVERRUNS + MAX_DEVICES * 4 <= SIZE);
};

/// One device's figures, as the process numbers its devices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceFigures {
    pub ordinal: u32,
    pub uuid: Option<String>,
    pub budget: u64,
    pub used: u64,
    pub peak: u64,
    pub denials: u64,
    pub waits: u64,
    /// Allocations admitted past the budget (`CUDABUDGET_ON_EXCEED=warn`); the record
    /// keeps up to `u32::MAX`.
    pub overruns: u64,
}

/// What one budgeted process publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub pid: u32,
    pub start_time: u64,
    pub pid_namespace: u64,
    pub updated_ms: u64,
    pub sequence: u64,
    pub job: Option<String>,
    pub command: String,
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub container: Option<String>,
    pub devices: Vec<DeviceFigures>,
}

/// Why bytes are not a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalid {
    Size(usize),
    Magic,
    Version(u32),
    /// The checksum does not match: torn by a concurrent write, or damaged.
    Checksum,
    Field(&'static str),
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::Size(n) => write!(f, "{n} bytes, not {SIZE}"),
            Invalid::Magic => write!(f, "not a cudabudget record"),
            Invalid::Version(v) => write!(f, "record version {v}, this build reads {VERSION}"),
            Invalid::Checksum => write!(f, "checksum mismatch"),
            Invalid::Field(name) => write!(f, "field {name} out of bounds"),
        }
    }
}

/// FNV-1a, 64 bits.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// FNV-1a of the record with its checksum field as zeros. A plain indexed loop: a
/// reader checks thousands of files, and so stays fast in a debug build too.
#[allow(clippy::manual_range_contains)] // no call per byte in a debug build
fn checksum(buf: &[u8; SIZE]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < SIZE {
        let b = if i >= 16 && i < 24 { 0 } else { buf[i] };
        hash = (hash ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

fn put_u16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(buf: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([buf[at], buf[at + 1]])
}
fn get_u32(buf: &[u8], at: usize) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}
fn get_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

/// `text` cut to at most `max` bytes at a character boundary.
pub fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl Record {
    /// The record as the bytes of its file (checksum included). Text longer than its
    /// field is cut; devices past [`MAX_DEVICES`] are left out.
    pub fn encode(&self, buf: &mut [u8; SIZE]) {
        buf.fill(0);
        buf[0..8].copy_from_slice(&MAGIC);
        put_u32(buf, 8, VERSION);
        put_u32(buf, 12, SIZE as u32);
        put_u32(buf, 24, self.pid);
        let devices = &self.devices[..self.devices.len().min(MAX_DEVICES)];
        put_u32(buf, 28, devices.len() as u32);
        put_u64(buf, 32, self.start_time);
        put_u64(buf, 40, self.pid_namespace);
        put_u64(buf, 48, self.updated_ms);
        put_u64(buf, 56, self.sequence);
        let texts = [
            self.job.as_deref(),
            Some(self.command.as_str()),
            self.pod.as_deref(),
            self.namespace.as_deref(),
            self.container.as_deref(),
        ];
        let mut at = STRINGS;
        for (i, (text, (_, capacity))) in texts.iter().zip(FIELDS).enumerate() {
            match text {
                None => put_u16(buf, LENGTHS + 2 * i, ABSENT),
                Some(text) => {
                    let text = truncate(text, capacity);
                    put_u16(buf, LENGTHS + 2 * i, text.len() as u16);
                    buf[at..at + text.len()].copy_from_slice(text.as_bytes());
                }
            }
            at += capacity;
        }
        for (i, d) in devices.iter().enumerate() {
            let at = DEVICES + i * DEVICE_SIZE;
            put_u32(buf, at, d.ordinal);
            put_u64(buf, at + 8, d.budget.min(MAX_FIGURE));
            put_u64(buf, at + 16, d.used.min(MAX_FIGURE));
            put_u64(buf, at + 24, d.peak.min(MAX_FIGURE));
            put_u64(buf, at + 32, d.denials.min(MAX_FIGURE));
            put_u64(buf, at + 40, d.waits.min(MAX_FIGURE));
            put_u32(
                buf,
                OVERRUNS + 4 * i,
                d.overruns.min(u64::from(u32::MAX)) as u32,
            );
            if let Some(uuid) = &d.uuid {
                let uuid = truncate(uuid, UUID_LEN);
                put_u32(buf, at + 4, 1);
                buf[at + 48..at + 48 + uuid.len()].copy_from_slice(uuid.as_bytes());
            }
        }
        let sum = checksum(buf);
        put_u64(buf, 16, sum);
    }

    /// Reads a record, checking everything it relies on.
    pub fn decode(bytes: &[u8]) -> Result<Record, Invalid> {
        let buf: &[u8; SIZE] = bytes.try_into().map_err(|_| Invalid::Size(bytes.len()))?;
        if buf[0..8] != MAGIC {
            return Err(Invalid::Magic);
        }
        let version = get_u32(buf, 8);
        if version != VERSION {
            return Err(Invalid::Version(version));
        }
        if get_u32(buf, 12) as usize != SIZE {
            return Err(Invalid::Field("size"));
        }
        if get_u64(buf, 16) != checksum(buf) {
            return Err(Invalid::Checksum);
        }
        let count = get_u32(buf, 28) as usize;
        if count > MAX_DEVICES {
            return Err(Invalid::Field("device count"));
        }
        let mut texts: [Option<String>; 5] = Default::default();
        let mut at = STRINGS;
        for (i, (name, capacity)) in FIELDS.into_iter().enumerate() {
            let len = get_u16(buf, LENGTHS + 2 * i);
            if len != ABSENT {
                let len = len as usize;
                if len > capacity {
                    return Err(Invalid::Field(name));
                }
                texts[i] = Some(String::from_utf8_lossy(&buf[at..at + len]).into_owned());
            }
            at += capacity;
        }
        let mut devices = Vec::with_capacity(count);
        for i in 0..count {
            let at = DEVICES + i * DEVICE_SIZE;
            let uuid = (get_u32(buf, at + 4) & 1 == 1).then(|| {
                let field = &buf[at + 48..at + 48 + UUID_LEN];
                let len = field.iter().position(|&b| b == 0).unwrap_or(UUID_LEN);
                String::from_utf8_lossy(&field[..len]).into_owned()
            });
            let figure = |offset: usize, name: &'static str| {
                let value = get_u64(buf, at + offset);
                if value > MAX_FIGURE {
                    Err(Invalid::Field(name))
                } else {
                    Ok(value)
                }
            };
            let ordinal = get_u32(buf, at);
            if ordinal as usize >= MAX_DEVICES {
                return Err(Invalid::Field("device ordinal"));
            }
            devices.push(DeviceFigures {
                ordinal,
                uuid,
                budget: figure(8, "budget")?,
                used: figure(16, "used")?,
                peak: figure(24, "peak")?,
                denials: figure(32, "denials")?,
                waits: figure(40, "waits")?,
                overruns: u64::from(get_u32(buf, OVERRUNS + 4 * i)),
            });
        }
        if get_u32(buf, 24) == 0 {
            return Err(Invalid::Field("pid"));
        }
        let [job, command, pod, namespace, container] = texts;
        Ok(Record {
            pid: get_u32(buf, 24),
            start_time: get_u64(buf, 32),
            pid_namespace: get_u64(buf, 40),
            updated_ms: get_u64(buf, 48),
            sequence: get_u64(buf, 56),
            job,
            command: command.ok_or(Invalid::Field("command"))?,
            pod,
            namespace,
            container,
            devices,
        })
    }
}

/// A GPU's UUID as NVML and `nvidia-smi` write it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`)
/// from the 16 bytes the driver gives (`cuDeviceGetUuid`): how records, the views and the
/// command line name a GPU.
pub fn gpu_uuid(b: &[u8; 16]) -> String {
    let hex =
        |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// The file name of the record of `pid` in PID namespace `namespace` (two containers
/// that share a runtime directory can have the same pids).
pub fn file_name(pid: u32, namespace: u64) -> String {
    format!("{pid}-{namespace}.rec")
}

/// The pid and namespace a record's file name names.
pub fn parse_file_name(name: &str) -> Option<(u32, u64)> {
    let (pid, namespace) = name.strip_suffix(".rec")?.split_once('-')?;
    let number = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    if !number(pid) || !number(namespace) {
        return None;
    }
    let pid: u32 = pid.parse().ok().filter(|&pid| pid != 0)?;
    Some((pid, namespace.parse().ok()?))
}

/// A process's command line as records show it: `/proc/<pid>/cmdline`'s arguments joined
/// by spaces (empty ones dropped, bytes that are not UTF-8 replaced).
pub fn command_line(cmdline: &[u8]) -> String {
    cmdline
        .split(|&b| b == 0)
        .filter(|arg| !arg.is_empty())
        .map(String::from_utf8_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The start time (field 22, clock ticks since boot) in the bytes of `/proc/<pid>/stat`.
/// The command name (field 2) may hold spaces, parentheses and bytes that are not UTF-8
/// (a name cut to 15 bytes in the middle of a character, `prctl(PR_SET_NAME)`), so the
/// file is read as bytes and fields are counted after its last `)`.
pub fn start_time_from_stat(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    // Field 3 (state) is the first after the name: field 22 is the 20th from there.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The inode in a `/proc/<pid>/ns/pid` link target (`pid:[4026531836]`).
pub fn namespace_inode(link: &str) -> Option<u64> {
    link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            pid: 4242,
            start_time: 123_456,
            pid_namespace: 4_026_531_836,
            updated_ms: 1_700_000_000_000,
            sequence: 7,
            job: Some("train".into()),
            command: "python train.py --lr 0.1".into(),
            pod: Some("trainer-0".into()),
            namespace: None,
            container: Some("main".into()),
            devices: vec![
                DeviceFigures {
                    ordinal: 0,
                    uuid: Some("GPU-faceb00c-0000-0000-0000-000000000000".into()),
                    budget: 8 << 30,
                    used: 5 << 30,
                    peak: 6 << 30,
                    denials: 3,
                    waits: 0,
                    overruns: 12,
                },
                DeviceFigures {
                    ordinal: 3,
                    uuid: None,
                    budget: 1 << 30,
                    ..Default::default()
                },
            ],
        }
    }

    #[test]
    fn a_record_reads_back_as_it_was_written() {
        let mut buf = [0u8; SIZE];
        sample().encode(&mut buf);
        assert_eq!(Record::decode(&buf), Ok(sample()));
    }

    #[test]
    fn overruns_stop_at_the_most_a_record_keeps_and_an_older_record_has_none() {
        let mut record = sample();
        record.devices[1].overruns = u64::MAX;
        let mut buf = [0u8; SIZE];
        record.encode(&mut buf);
        let back = Record::decode(&buf).unwrap();
        assert_eq!(back.devices[0].overruns, 12);
        assert_eq!(back.devices[1].overruns, u64::from(u32::MAX));
        // A library that predates them left the place zero, under its checksum.
        buf[OVERRUNS..OVERRUNS + 8].fill(0);
        let sum = checksum(&buf);
        put_u64(&mut buf, 16, sum);
        let back = Record::decode(&buf).unwrap();
        assert_eq!(
            back.devices.iter().map(|d| d.overruns).collect::<Vec<_>>(),
            [0, 0]
        );
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary() {
        let mut record = sample();
        record.command = "é".repeat(600);
        let mut buf = [0u8; SIZE];
        record.encode(&mut buf);
        let back = Record::decode(&buf).unwrap();
        assert_eq!(back.command, "é".repeat(512));
    }

    #[test]
    fn any_changed_byte_is_refused() {
        let mut buf = [0u8; SIZE];
        sample().encode(&mut buf);
        for at in [0, 9, 13, 17, 25, 40, 100, 2000, SIZE - 1] {
            let mut bad = buf;
            bad[at] ^= 0x40;
            assert!(Record::decode(&bad).is_err(), "byte {at}");
        }
        assert_eq!(Record::decode(&buf[..100]), Err(Invalid::Size(100)));
    }

    #[test]
    fn counts_and_lengths_past_the_layout_are_refused_even_with_a_good_checksum() {
        let mut buf = [0u8; SIZE];
        sample().encode(&mut buf);
        let reseal = |buf: &mut [u8; SIZE]| {
            let sum = checksum(buf);
            put_u64(buf, 16, sum);
        };
        let mut bad = buf;
        put_u32(&mut bad, 28, 65);
        reseal(&mut bad);
        assert_eq!(Record::decode(&bad), Err(Invalid::Field("device count")));
        let mut bad = buf;
        put_u16(&mut bad, LENGTHS, 129);
        reseal(&mut bad);
        assert_eq!(Record::decode(&bad), Err(Invalid::Field("job")));
        let mut bad = buf;
        put_u32(&mut bad, 8, 2);
        reseal(&mut bad);
        assert_eq!(Record::decode(&bad), Err(Invalid::Version(2)));
    }

    #[test]
    fn figures_past_any_card_are_clamped_by_the_writer_and_refused_by_readers() {
        let mut record = sample();
        record.devices[0].used = u64::MAX;
        let mut buf = [0u8; SIZE];
        record.encode(&mut buf);
        assert_eq!(Record::decode(&buf).unwrap().devices[0].used, MAX_FIGURE);
        // A forger writes what the writer never does, and seals it.
        put_u64(&mut buf, DEVICES + 16, 9_223_372_036_854_775_807);
        let sum = checksum(&buf);
        put_u64(&mut buf, 16, sum);
        assert_eq!(Record::decode(&buf), Err(Invalid::Field("used")));
        put_u64(&mut buf, DEVICES + 16, 0);
        put_u32(&mut buf, DEVICES, 64);
        let sum = checksum(&buf);
        put_u64(&mut buf, 16, sum);
        assert_eq!(Record::decode(&buf), Err(Invalid::Field("device ordinal")));
    }

    /// splitmix64.
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// What a record that passed must hold, whatever its bytes were.
    fn holds_its_checks(bytes: &[u8], record: &Record) {
        let buf: &[u8; SIZE] = bytes.try_into().expect("only full-size records pass");
        assert_eq!(get_u64(buf, 16), checksum(buf));
        assert!(record.devices.len() <= MAX_DEVICES);
        assert_ne!(record.pid, 0);
        for d in &record.devices {
            assert!((d.ordinal as usize) < MAX_DEVICES);
            for figure in [d.budget, d.used, d.peak, d.denials, d.waits] {
                assert!(figure <= MAX_FIGURE);
            }
        }
        for (text, (_, capacity)) in [
            record.job.as_deref(),
            Some(record.command.as_str()),
            record.pod.as_deref(),
            record.namespace.as_deref(),
            record.container.as_deref(),
        ]
        .into_iter()
        .zip(FIELDS)
        {
            // Lossy UTF-8 may widen an invalid byte to 3: bounded all the same.
            assert!(text.map_or(0, str::len) <= 3 * capacity);
        }
    }

    /// Random bytes, truncations, and a forger's edits of a good record (resealed, so
    /// that the checks past the checksum are what stands): never a panic, and nothing
    /// accepted that breaks a check. `PROPTEST_CASES` cases (default 5000).
    #[test]
    fn any_bytes_are_refused_or_read_within_the_layout_never_a_panic() {
        let cases: u64 = std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(5000);
        let mut state = 25;
        let mut good = [0u8; SIZE];
        sample().encode(&mut good);
        let mut accepted = 0u64;
        for case in 0..cases {
            let mut bytes = good.to_vec();
            match case % 4 {
                0 => bytes.iter_mut().for_each(|b| *b = next(&mut state) as u8),
                1 => bytes.truncate((next(&mut state) % (SIZE as u64 + 1)) as usize),
                _ => {
                    for _ in 0..1 + next(&mut state) % 16 {
                        let at = (next(&mut state) % SIZE as u64) as usize;
                        let width = [1, 2, 4, 8][(next(&mut state) % 4) as usize];
                        let at = at.min(SIZE - width);
                        let value = match next(&mut state) % 4 {
                            0 => u64::MAX,
                            1 => 0,
                            2 => next(&mut state) % 300,
                            _ => next(&mut state),
                        };
                        bytes[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
                    }
                    if case % 4 == 2 {
                        let buf: &mut [u8; SIZE] = (&mut bytes[..]).try_into().unwrap();
                        let sum = checksum(buf);
                        put_u64(buf, 16, sum);
                    }
                    if next(&mut state).is_multiple_of(8) {
                        bytes.push(0);
                    }
                }
            }
            if let Ok(record) = Record::decode(&bytes) {
                holds_its_checks(&bytes, &record);
                accepted += 1;
            }
        }
        assert!(
            cases < 100 || accepted > 0,
            "the forger's cases reach past the checksum"
        );
    }

    #[test]
    fn uuids_are_written_as_nvml_writes_them() {
        let mut b = [0u8; 16];
        b[0] = 0xfa;
        b[15] = 0x01;
        assert_eq!(gpu_uuid(&b), "GPU-fa000000-0000-0000-0000-000000000001");
    }

    #[test]
    fn names_and_proc_fields_are_parsed_strictly() {
        assert_eq!(
            parse_file_name(&file_name(77, 4026531836)),
            Some((77, 4026531836))
        );
        assert_eq!(parse_file_name("77-0.rec"), Some((77, 0)));
        assert_eq!(parse_file_name("0-1.rec"), None);
        assert_eq!(parse_file_name("77.rec"), None);
        assert_eq!(parse_file_name("../7-1.rec"), None);
        assert_eq!(parse_file_name("7-1.rec.tmp"), None);
        let stat = "42 (a) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(start_time_from_stat(stat.as_bytes()), Some(987_654));
        // A name cut in the middle of a character is not UTF-8; the start time is read.
        let cut =
            b"42 (a\xe8\xae) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(start_time_from_stat(cut), Some(987_654));
        assert_eq!(namespace_inode("pid:[4026531836]"), Some(4_026_531_836));
        assert_eq!(namespace_inode("net:[1]"), None);
    }
}
