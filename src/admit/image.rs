//! What a module image says it places on the device, read before the driver loads it:
//! a cubin's (ELF64) global, constant and code sections; from a fatbinary, the entry the
//! driver would choose for the device (the cubin of the device's architecture, else the
//! best lower one of the same major, else the newest PTX it can JIT), expanded first where
//! it is compressed (LZ4 or Zstandard, as nvcc writes them); PTX's declared `.global` and
//! `.const` variables.
//!
//! Every image is untrusted input: all of it is read through [`Source`] (bounds-checked
//! copies, never a pointer past what was read), arithmetic saturates, sizes of tables are
//! bounded, a compressed entry is expanded to no more than it says and [`MAX_UNPACKED`],
//! and nothing here panics (the decoders run under `catch_unwind` all the same). No
//! driver, no I/O of its own: the one thing from outside is the system's Zstandard
//! decoder ([`crate::sys::zstd`]), loaded at the first compressed frame.
//!
//! What it cannot say, it says so ([`Unknown`]): a compressed fatbinary entry that does not
//! expand here, a format other than these three, an image with no entry for the device, a
//! malformed one.

/// Bytes an image is read from: copies `buf.len()` bytes at `at`, or says they are not
/// all there.
pub trait Source {
    fn read(&self, at: u64, buf: &mut [u8]) -> bool;
}

impl Source for [u8] {
    fn read(&self, at: u64, buf: &mut [u8]) -> bool {
        let Ok(at) = usize::try_from(at) else {
            return false;
        };
        match at.checked_add(buf.len()).and_then(|end| self.get(at..end)) {
            Some(bytes) => {
                buf.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }
}

/// A window of `len` bytes at `base` of another source (a fatbinary entry's payload).
struct Window<'a, S: Source + ?Sized> {
    src: &'a S,
    base: u64,
    len: u64,
}

impl<S: Source + ?Sized> Source for Window<'_, S> {
    fn read(&self, at: u64, buf: &mut [u8]) -> bool {
        match at.checked_add(buf.len() as u64) {
            Some(end) if end <= self.len => self
                .base
                .checked_add(at)
                .is_some_and(|at| self.src.read(at, buf)),
            _ => false,
        }
    }
}

/// The device's compute capability, as `major * 10 + minor` (9.0: 90, 12.0: 120), the
/// numbering of a fatbinary's entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch(pub u32);

impl Arch {
    pub fn new(major: u32, minor: u32) -> Self {
        Arch(major.saturating_mul(10).saturating_add(minor))
    }
    fn major(self) -> u32 {
        self.0 / 10
    }
}

/// What an image says about the device memory its load takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Footprint {
    Placed(Placed),
    /// The image cannot say.
    Unknown(Unknown),
}

/// The device memory an image's load places, in two parts: the module's data, placed
/// when the module is (globals and its constant banks), and its kernels' code with each
/// kernel's parameter bank (`.nv.constant0.<kernel>`), which lazy loading (CUDA's
/// default) places only at the kernel's first use. PTX says nothing of its code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub data: u64,
    pub code: u64,
}

/// Why an image cannot say what it places on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unknown {
    /// Not a cubin, a fatbinary or PTX text.
    Format,
    /// The entry the driver would load is compressed and does not expand here: a codec
    /// not known here, bytes that do not decode, or more than [`MAX_UNPACKED`].
    Compressed,
    /// The entry the driver would load is compressed, and was not expanded: asked of
    /// [`footprint_unexpanded`].
    Unexpanded,
    /// A fatbinary with nothing for this device (the driver will refuse it).
    NoEntry,
    /// Headers that point outside the image, or tables past the bounds kept here.
    Malformed,
}

/// The magic of a fatbinary wrapper (`__fatBinC_Wrapper_t`: magic, version, a pointer to
/// the fatbinary, a pointer cudart uses): the caller follows the pointer, this module
/// never does.
pub const WRAPPER_MAGIC: u32 = 0x466243b1;
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];

/// Sections the driver places in device memory: code and the kernels' parameter banks
/// ([`CODE_SECTIONS`]); the other constant banks and the globals (`.nv.global` holds the
/// uninitialised ones and takes no room in the file, `.nv.global.init` the initialised
/// ones). Shared and local memory are not allocated per module, and the rest
/// (`.nv.info*`, symbols, relocations, `.rela.nv.constant*`) stays on the host.
const CODE_SECTIONS: [&[u8]; 2] = [b".text", b".nv.constant0"];
const DATA_SECTIONS: [&[u8]; 2] = [b".nv.constant", b".nv.global"];

/// Bounds on what is read of an image: beyond them it is called malformed.
const MAX_SECTION_TABLE: u64 = 1 << 24;
const MAX_NAMES: u64 = 1 << 24;
const MAX_ENTRIES: usize = 4096;
const MAX_PTX: u64 = 1 << 28;
/// The most a compressed fatbinary entry is expanded to (and read of its compressed
/// bytes): as much PTX as is read uncompressed; a cubin for one architecture is far
/// smaller (sizes of NOBITS globals are numbers in it, not bytes).
pub const MAX_UNPACKED: u64 = MAX_PTX;

/// The device memory `image` says its load takes on a device of `arch`.
pub fn footprint(image: &(impl Source + ?Sized), arch: Arch) -> Footprint {
    footprint_in(image, arch, true)
}

/// As [`footprint`], without expanding a compressed entry (the costly part, for an image
/// that may never be used): [`Unknown::Unexpanded`] instead.
pub fn footprint_unexpanded(image: &(impl Source + ?Sized), arch: Arch) -> Footprint {
    footprint_in(image, arch, false)
}

fn footprint_in(image: &(impl Source + ?Sized), arch: Arch, expand: bool) -> Footprint {
    let mut magic = [0u8; 4];
    if !image.read(0, &mut magic) {
        // Shorter than four bytes: PTX text at most ("" is not a module).
        return ptx_or_unknown(image);
    }
    if magic == ELF_MAGIC {
        return cubin(image);
    }
    match u32::from_le_bytes(magic) {
        FATBIN_MAGIC => fatbin(image, arch, expand),
        WRAPPER_MAGIC => Footprint::Unknown(Unknown::Format),
        _ => ptx_or_unknown(image),
    }
}

/// The fatbinary a wrapper at the start of `image` points to, if it is one.
pub fn wrapped(image: &(impl Source + ?Sized)) -> Option<u64> {
    let magic = read_u32(image, 0)?;
    (magic == WRAPPER_MAGIC)
        .then(|| read_u64(image, 8))
        .flatten()
        .filter(|&p| p != 0)
}

fn read_array<const N: usize>(src: &(impl Source + ?Sized), at: u64) -> Option<[u8; N]> {
    let mut buf = [0u8; N];
    src.read(at, &mut buf).then_some(buf)
}
fn read_u16(src: &(impl Source + ?Sized), at: u64) -> Option<u16> {
    read_array(src, at).map(u16::from_le_bytes)
}
fn read_u32(src: &(impl Source + ?Sized), at: u64) -> Option<u32> {
    read_array(src, at).map(u32::from_le_bytes)
}
fn read_u64(src: &(impl Source + ?Sized), at: u64) -> Option<u64> {
    read_array(src, at).map(u64::from_le_bytes)
}
fn read_vec(src: &(impl Source + ?Sized), at: u64, len: u64, max: u64) -> Option<Vec<u8>> {
    if len > max {
        return None;
    }
    let mut buf = zeroed(usize::try_from(len).ok()?)?;
    src.read(at, &mut buf).then_some(buf)
}

/// `len` zeroed bytes, or `None` where the memory cannot be had: an allocation failure
/// would abort the program (no `catch_unwind` catches it), a load that cannot say does
/// not.
fn zeroed(len: usize) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len).ok()?;
    buf.resize(len, 0);
    Some(buf)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u16::from_le_bytes)
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

const MALFORMED: Footprint = Footprint::Unknown(Unknown::Malformed);

/// A cubin: the sizes of its device sections, by their names in the section-name table.
fn cubin(image: &(impl Source + ?Sized)) -> Footprint {
    cubin_sections(image).map_or(MALFORMED, Footprint::Placed)
}

fn cubin_sections(image: &(impl Source + ?Sized)) -> Option<Placed> {
    let header: [u8; 64] = read_array(image, 0)?;
    // ELFCLASS64, little-endian: what nvcc has made for every architecture CUDA 12
    // and 13 support.
    if header[4] != 2 || header[5] != 1 {
        return None;
    }
    let shoff = u64_at(&header, 0x28);
    let shentsize = u64::from(u16_at(&header, 0x3a));
    let shnum = u64::from(u16_at(&header, 0x3c));
    let shstrndx = u64::from(u16_at(&header, 0x3e));
    if shnum == 0 {
        return Some(Placed::default());
    }
    if shentsize < 64 || shstrndx >= shnum {
        return None;
    }
    let table = read_vec(
        image,
        shoff,
        shnum.checked_mul(shentsize)?,
        MAX_SECTION_TABLE,
    )?;
    let entry = |i: u64| -> &[u8] {
        let at = (i * shentsize) as usize;
        table.get(at..at + 64).unwrap_or(&[])
    };
    let names_header = entry(shstrndx);
    let names = read_vec(
        image,
        u64_at(names_header, 0x18),
        u64_at(names_header, 0x20),
        MAX_NAMES,
    )?;
    let mut placed = Placed::default();
    for i in 0..shnum {
        let section = entry(i);
        let name_at = u32_at(section, 0) as usize;
        let name = names.get(name_at..).unwrap_or(&[]);
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        let size = u64_at(section, 0x20);
        if CODE_SECTIONS.iter().any(|p| name.starts_with(p)) {
            placed.code = placed.code.saturating_add(size);
        } else if DATA_SECTIONS.iter().any(|p| name.starts_with(p)) {
            placed.data = placed.data.saturating_add(size);
        }
    }
    Some(placed)
}

/// One entry of a fatbinary.
struct Entry {
    kind: u16,
    arch: u32,
    /// How its payload is stored.
    packing: Packing,
    /// Where its payload starts, and its length (padded to 8 bytes where compressed).
    at: u64,
    len: u64,
    /// A compressed payload's own length, and the length it expands to.
    packed: u64,
    unpacked: u64,
}

const KIND_PTX: u16 = 1;
const KIND_ELF: u16 = 2;

/// How an entry's payload is stored, from its flags (the word at 40 of its header).
///
/// The format, which NVIDIA does not document: the entry header's fields (the payload's
/// length padded to 8 bytes at 8, its compressed length at 16, the flags at 40, the
/// expanded length at 56) are those that ZLUDA (vosen/ZLUDA, `dark_api/src/fatbin.rs` and
/// `FatbinFileHeader`), n-eiling/cuda-fatbin-decompression, jiegec/fatbinary and
/// GrigoryEvko/nvopen-tools (`fatbin/FORMAT_SPECIFICATION.md`, from cuobjdump 11–13) read;
/// `0x2000` marks a raw LZ4 block (what `-Xfatbin=-compress-all` wrote before CUDA 12.8,
/// and `--compress-mode=speed` writes) and `0x8000` one Zstandard frame (CUDA 12.8 on:
/// the default mode, `size`, and cubins under `-compress-all`), as ZLUDA decodes them
/// (`LZ4_decompress_safe`, `ZSTD_decompress`) and a public test of libnvfatbin 13.0 saw
/// them written. What `--compress-mode=balance` writes was not confirmed: either of the
/// two is read; a flag of another codec is not, and such an entry is measured at its load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Packing {
    Stored,
    Lz4,
    Zstd,
    /// Both flags: nothing nvcc writes.
    Unknown,
}

const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;

impl Packing {
    fn of(flags: u64) -> Packing {
        match (flags & FLAG_LZ4 != 0, flags & FLAG_ZSTD != 0) {
            (false, false) => Packing::Stored,
            (true, false) => Packing::Lz4,
            (false, true) => Packing::Zstd,
            (true, true) => Packing::Unknown,
        }
    }
}

/// A fatbinary: the entry the driver would choose for `arch`, sized (`expand`: expanded
/// first where it is compressed).
fn fatbin(image: &(impl Source + ?Sized), arch: Arch, expand: bool) -> Footprint {
    let Some(entries) = fatbin_entries(image) else {
        return MALFORMED;
    };
    let elf = |e: &&Entry| e.kind == KIND_ELF;
    let exact = entries.iter().filter(elf).find(|e| e.arch == arch.0);
    let lower = || {
        entries
            .iter()
            .filter(elf)
            .filter(|e| e.arch / 10 == arch.major() && e.arch < arch.0)
            .max_by_key(|e| e.arch)
    };
    let jit = || {
        entries
            .iter()
            .filter(|e| e.kind == KIND_PTX && e.arch <= arch.0)
            .max_by_key(|e| e.arch)
    };
    let Some(chosen) = exact.or_else(lower).or_else(jit) else {
        return Footprint::Unknown(Unknown::NoEntry);
    };
    if chosen.packing != Packing::Stored && !expand {
        return Footprint::Unknown(Unknown::Unexpanded);
    }
    if chosen.packing != Packing::Stored {
        return match unpack(image, chosen) {
            Some(payload) => entry_footprint(&payload[..], chosen.kind),
            None => Footprint::Unknown(Unknown::Compressed),
        };
    }
    let payload = Window {
        src: image,
        base: chosen.at,
        len: chosen.len,
    };
    entry_footprint(&payload, chosen.kind)
}

fn entry_footprint(payload: &(impl Source + ?Sized), kind: u16) -> Footprint {
    if kind == KIND_ELF {
        cubin(payload)
    } else {
        ptx(payload).map_or(MALFORMED, ptx_placed)
    }
}

/// A compressed entry's payload, expanded: `None` when it does not expand to exactly what
/// its header says, or that is more than [`MAX_UNPACKED`]. The compressed bytes are read
/// whole (bounded as well); nothing is allocated for the expanded bytes beyond what the
/// header says, and for LZ4 beyond what its compressed length can expand to.
fn unpack(image: &(impl Source + ?Sized), entry: &Entry) -> Option<Vec<u8>> {
    // The compressed length, within the padded one; 0 where a writer left it out.
    let packed = if entry.packed == 0 || entry.packed > entry.len {
        entry.len
    } else {
        entry.packed
    };
    if entry.unpacked == 0 || entry.unpacked > MAX_UNPACKED {
        return None;
    }
    let bytes = read_vec(image, entry.at, packed, MAX_UNPACKED)?;
    let unpacked = usize::try_from(entry.unpacked).ok()?;
    let packing = entry.packing;
    // The decoders return errors for bad input; a panic in one of them must not end the
    // load (here, the hook's guard would make it CUDA_ERROR_UNKNOWN): it cannot say.
    std::panic::catch_unwind(move || match packing {
        Packing::Lz4 => unlz4(&bytes, unpacked),
        Packing::Zstd => unzstd(&bytes, unpacked),
        Packing::Stored | Packing::Unknown => None,
    })
    .ok()
    .flatten()
}

/// One raw LZ4 block (no frame, no size prefix), expanding to `unpacked` bytes.
fn unlz4(packed: &[u8], unpacked: usize) -> Option<Vec<u8>> {
    // An LZ4 byte expands to 255 at most (a match length's continuation byte): a header
    // saying more than that is not believed.
    if unpacked > packed.len().saturating_mul(255) {
        return None;
    }
    let mut out = zeroed(unpacked)?;
    let n = lz4_flex::block::decompress_into(packed, &mut out).ok()?;
    (n == unpacked).then_some(out)
}

/// One Zstandard frame, expanding to exactly `unpacked` bytes: by the system's decoder
/// where it is there ([`crate::sys::zstd`], five times as fast), else by [`unzstd_here`].
fn unzstd(packed: &[u8], unpacked: usize) -> Option<Vec<u8>> {
    let mut out = zeroed(unpacked)?;
    match crate::sys::zstd::decompress(packed, &mut out) {
        Some(written) => (written == Some(unpacked)).then_some(out),
        None => unzstd_here(packed, unpacked),
    }
}

/// One Zstandard frame, expanding to `unpacked` bytes: the output grows with what decodes,
/// and the frame's window (the decoder's own buffer, reserved at the frame's start) may
/// not exceed the expanded size rounded up to a power of two (zstd's window for an input
/// of known size) or 8 MiB (its window up to level 19 for one of unknown size), whichever
/// is larger.
fn unzstd_here(packed: &[u8], unpacked: usize) -> Option<Vec<u8>> {
    use std::io::Read;
    let window = (unpacked.max(8 << 20) as u64).checked_next_power_of_two()?;
    let mut decoder =
        ruzstd::decoding::StreamingDecoder::new_with_max_window_size(packed, window).ok()?;
    // Room for the whole output (and the one byte more that tells a longer frame) up
    // front, so that reading never grows it, nor fails to.
    let mut out = Vec::new();
    out.try_reserve_exact(unpacked.checked_add(1)?).ok()?;
    (&mut decoder)
        .take(unpacked as u64 + 1)
        .read_to_end(&mut out)
        .ok()?;
    (out.len() == unpacked).then_some(out)
}

/// The entries of the fatbinary at the start of `image`: its 16-byte header (magic,
/// version, header size, size of what follows), then entries, each a header (kind,
/// its own size, the payload's size padded, …, the compressed size at 16, the
/// architecture at 28, flags at 40, the expanded size at 56) and its payload.
fn fatbin_entries(image: &(impl Source + ?Sized)) -> Option<Vec<Entry>> {
    let header_size = u64::from(read_u16(image, 6)?);
    let size = read_u64(image, 8)?;
    let end = header_size.checked_add(size)?;
    let mut entries = Vec::new();
    let mut at = header_size;
    while at < end {
        if entries.len() == MAX_ENTRIES {
            return None;
        }
        let head: [u8; 64] = read_array(image, at)?;
        let head_size = u64::from(u32_at(&head, 4));
        let len = u64_at(&head, 8);
        if head_size < 64 {
            return None;
        }
        let payload = at.checked_add(head_size)?;
        let next = payload.checked_add(len)?;
        if next > end {
            return None;
        }
        entries.push(Entry {
            kind: u16_at(&head, 0),
            arch: u32_at(&head, 28),
            packing: Packing::of(u64_at(&head, 40)),
            at: payload,
            len,
            packed: u64::from(u32_at(&head, 16)),
            unpacked: u64_at(&head, 56),
        });
        at = next;
    }
    Some(entries)
}

/// PTX text, NUL-terminated or ending with the image.
fn ptx_or_unknown(image: &(impl Source + ?Sized)) -> Footprint {
    match ptx(image) {
        Some(bytes) => ptx_placed(bytes),
        None => Footprint::Unknown(Unknown::Format),
    }
}

fn ptx_placed(data: u64) -> Footprint {
    Footprint::Placed(Placed { data, code: 0 })
}

/// Reads PTX text from `image` (up to a NUL, the end of the image, or [`MAX_PTX`]) and
/// sizes its declared globals; `None` when it is not PTX.
fn ptx(image: &(impl Source + ?Sized)) -> Option<u64> {
    let text = read_text(image)?;
    let looks_like_ptx = find(&text, b".version").is_some() && find(&text, b".target").is_some();
    looks_like_ptx.then(|| ptx_globals(&text))
}

fn is_text(b: u8) -> bool {
    b.is_ascii_graphic() || b.is_ascii_whitespace()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The text up to its NUL: read in chunks, halved where the image ends inside one (a
/// few reads, not one a byte, where each read may be a system call). `None` at the first
/// byte that is not ASCII text: other formats are not read further than that.
fn read_text(image: &(impl Source + ?Sized)) -> Option<Vec<u8>> {
    const CHUNK: usize = 1 << 16;
    let mut text = Vec::new();
    let mut chunk = vec![0u8; CHUNK];
    let mut size = CHUNK;
    loop {
        let at = text.len() as u64;
        if at >= MAX_PTX {
            return None;
        }
        let part = &mut chunk[..size];
        if image.read(at, part) {
            let nul = part.iter().position(|&b| b == 0);
            let part = &part[..nul.unwrap_or(size)];
            if !part.iter().all(|&b| is_text(b)) {
                return None;
            }
            text.extend_from_slice(part);
            if nul.is_some() {
                return Some(text);
            }
        } else if size > 1 {
            size /= 2;
        } else {
            return Some(text);
        }
    }
}

/// A PTX token: a word (directive, type, name, number) or one punctuation byte.
fn tokens(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let word = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'$' | b'%');
    let mut i = 0;
    std::iter::from_fn(move || {
        loop {
            let rest = text.get(i..)?;
            let &b = rest.first()?;
            if b.is_ascii_whitespace() {
                i += 1;
            } else if rest.starts_with(b"//") {
                i += rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
            } else if rest.starts_with(b"/*") {
                i += find(rest, b"*/").map_or(rest.len(), |e| e + 2);
            } else if b == b'"' {
                // A string (only in `.file` directives): one token.
                let end = rest[1..]
                    .iter()
                    .position(|&c| c == b'"')
                    .map_or(rest.len(), |e| e + 2);
                i += end;
                return Some(&rest[..end]);
            } else if word(b) {
                let end = rest.iter().position(|&c| !word(c)).unwrap_or(rest.len());
                i += end;
                return Some(&rest[..end]);
            } else {
                i += 1;
                return Some(&rest[..1]);
            }
        }
    })
}

/// The bytes of every `.global` and `.const` variable a PTX module defines (`.extern`
/// ones are defined elsewhere): element size × vector width × array extents. An array
/// of unstated extent (`[]`) counts the elements of its initialiser.
fn ptx_globals(text: &[u8]) -> u64 {
    let mut toks = tokens(text).peekable();
    let mut total = 0u64;
    // `.global` elsewhere than at a declaration is a pointer parameter's attribute
    // (`.param .u64 .ptr .global .align 1 p`); instructions join it (`ld.global`).
    let mut previous: &[u8] = b";";
    // Whether the statement so far is `.extern`.
    let mut external = false;
    while let Some(t) = toks.next() {
        match t {
            b";" | b"{" | b"}" => external = false,
            b".extern" => external = true,
            b".global" | b".const" if previous != b".ptr" => {
                let bytes = declaration(&mut toks);
                if !external {
                    total = total.saturating_add(bytes);
                }
                external = false;
                previous = b";";
                continue;
            }
            _ => {}
        }
        previous = t;
    }
    total
}

/// The rest of a `.global`/`.const` declaration, up to and including its `;`: the sum
/// of its declarators' sizes.
fn declaration<'t>(toks: &mut std::iter::Peekable<impl Iterator<Item = &'t [u8]>>) -> u64 {
    let mut element = 0u64;
    let mut vector = 1u64;
    let mut total = 0u64;
    // Modifiers and the type, up to the first name.
    while let Some(&t) = toks.peek() {
        if t == b".align" {
            toks.next();
            toks.next();
        } else if let Some(v) = t.strip_prefix(b".v") {
            vector = number(v).unwrap_or(1).max(1);
            toks.next();
        } else if let Some(size) = type_size(t) {
            element = size;
            toks.next();
        } else if t.first() == Some(&b'.') {
            toks.next();
        } else {
            break;
        }
    }
    let unit = element.saturating_mul(vector);
    loop {
        // One declarator: name, extents, maybe an initialiser.
        let Some(name) = toks.next() else {
            return total;
        };
        if name == b";" {
            return total;
        }
        let mut extent = 1u64;
        let mut open = false;
        loop {
            match toks.peek().copied() {
                Some(b"[") => {
                    toks.next();
                    match toks.peek().copied() {
                        Some(b"]") => open = true,
                        Some(n) => {
                            extent = extent.saturating_mul(number(n).unwrap_or(0));
                            toks.next();
                        }
                        None => return total,
                    }
                    // Past the `]`.
                    for t in toks.by_ref() {
                        if t == b"]" {
                            break;
                        }
                    }
                }
                Some(b"<") => {
                    for t in toks.by_ref() {
                        if t == b">" {
                            break;
                        }
                    }
                }
                _ => break,
            }
        }
        let mut elements = None;
        if toks.peek().copied() == Some(b"=") {
            toks.next();
            elements = Some(initialiser(toks));
        }
        if open {
            extent = extent.saturating_mul(elements.unwrap_or(0));
        }
        total = total.saturating_add(unit.saturating_mul(extent));
        match toks.next() {
            Some(b",") => continue,
            _ => return total,
        }
    }
}

/// Skips an initialiser (`1`, `{1, 2, 3}`, nested braces) and counts its outermost
/// elements; leaves the `,` or `;` after it.
fn initialiser<'t>(toks: &mut std::iter::Peekable<impl Iterator<Item = &'t [u8]>>) -> u64 {
    let mut depth = 0u32;
    let mut elements = 1u64;
    while let Some(&t) = toks.peek() {
        match t {
            b"{" => depth += 1,
            b"}" => depth = depth.saturating_sub(1),
            b"," if depth == 1 => elements = elements.saturating_add(1),
            b"," | b";" if depth == 0 => return elements,
            _ => {}
        }
        toks.next();
    }
    elements
}

fn type_size(t: &[u8]) -> Option<u64> {
    Some(match t {
        b".b8" | b".u8" | b".s8" | b".pred" => 1,
        b".b16" | b".u16" | b".s16" | b".f16" | b".bf16" => 2,
        b".b32" | b".u32" | b".s32" | b".f32" | b".f16x2" | b".bf16x2" | b".tf32" => 4,
        b".b64" | b".u64" | b".s64" | b".f64" => 8,
        b".b128" => 16,
        _ => return None,
    })
}

/// A PTX integer: decimal, `0x` hex, `0` octal, `0b` binary, with an optional `U`.
fn number(t: &[u8]) -> Option<u64> {
    let t = t.strip_suffix(b"U").unwrap_or(t);
    let (digits, radix) = if let Some(h) = t.strip_prefix(b"0x").or(t.strip_prefix(b"0X")) {
        (h, 16)
    } else if let Some(b) = t.strip_prefix(b"0b").or(t.strip_prefix(b"0B")) {
        (b, 2)
    } else if t.len() > 1 && t[0] == b'0' {
        (&t[1..], 8)
    } else {
        (t, 10)
    };
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, radix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cubin with the named sections of the given sizes (plus a name table): the
    /// section bytes themselves are left out (sizes are what is read), as for NOBITS.
    pub(crate) fn cubin_with(sections: &[(&str, u64)]) -> Vec<u8> {
        let mut names = vec![0u8];
        let mut at = Vec::new();
        for (name, _) in sections {
            at.push(names.len() as u32);
            names.extend_from_slice(name.as_bytes());
            names.push(0);
        }
        let shstrtab_name = names.len() as u32;
        names.extend_from_slice(b".shstrtab\0");
        let shoff = 64 + names.len() as u64;
        let shnum = sections.len() as u16 + 2;
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(&ELF_MAGIC);
        elf[4] = 2;
        elf[5] = 1;
        elf[6] = 1;
        elf[0x12..0x14].copy_from_slice(&190u16.to_le_bytes());
        elf[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&(shnum - 1).to_le_bytes());
        elf.extend_from_slice(&names);
        elf.extend_from_slice(&[0u8; 64]);
        let section = |name: u32, kind: u32, offset: u64, size: u64| {
            let mut s = [0u8; 64];
            s[0..4].copy_from_slice(&name.to_le_bytes());
            s[4..8].copy_from_slice(&kind.to_le_bytes());
            s[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
            s[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            s
        };
        for (i, (_, size)) in sections.iter().enumerate() {
            elf.extend_from_slice(&section(at[i], 8, 0, *size));
        }
        elf.extend_from_slice(&section(shstrtab_name, 3, 64, names.len() as u64));
        elf
    }

    /// One fatbinary entry, header and payload: `packed` and `unpacked` are the header's
    /// compressed and expanded lengths (0 for a stored payload), and a compressed payload
    /// is padded to 8 bytes, as nvcc writes them.
    fn entry(
        kind: u16,
        arch: u32,
        flags: u64,
        payload: &[u8],
        packed: u32,
        unpacked: u64,
    ) -> Vec<u8> {
        // nvcc 13 gives PTX entries an 80-byte header, cubins 64 bytes.
        let mut head = vec![0u8; if kind == KIND_PTX { 80 } else { 64 }];
        let mut payload = payload.to_vec();
        if packed != 0 {
            payload.resize(payload.len().next_multiple_of(8), 0);
        }
        head[0..2].copy_from_slice(&kind.to_le_bytes());
        head[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
        let head_size = head.len() as u32;
        head[4..8].copy_from_slice(&head_size.to_le_bytes());
        head[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        head[16..20].copy_from_slice(&packed.to_le_bytes());
        head[28..32].copy_from_slice(&arch.to_le_bytes());
        head[40..48].copy_from_slice(&flags.to_le_bytes());
        head[56..64].copy_from_slice(&unpacked.to_le_bytes());
        head.extend_from_slice(&payload);
        head
    }

    /// `raw` compressed with `packing` and framed as nvcc frames it (flags 0x11 beside the
    /// codec's, as nvcc sets them on Linux for 64-bit code).
    fn packed_entry(kind: u16, arch: u32, packing: Packing, raw: &[u8]) -> Vec<u8> {
        let (flag, bytes) = match packing {
            Packing::Lz4 => (FLAG_LZ4, lz4_flex::block::compress(raw)),
            Packing::Zstd => (
                FLAG_ZSTD,
                ruzstd::encoding::compress_to_vec(raw, ruzstd::encoding::CompressionLevel::Fastest),
            ),
            Packing::Stored | Packing::Unknown => unreachable!(),
        };
        entry(
            kind,
            arch,
            0x11 | flag,
            &bytes,
            bytes.len() as u32,
            raw.len() as u64,
        )
    }

    fn fatbin_of(entries: &[Vec<u8>]) -> Vec<u8> {
        let body = entries.concat();
        let mut fat = Vec::new();
        fat.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        fat.extend_from_slice(&1u16.to_le_bytes());
        fat.extend_from_slice(&16u16.to_le_bytes());
        fat.extend_from_slice(&(body.len() as u64).to_le_bytes());
        fat.extend_from_slice(&body);
        fat
    }

    fn fatbin_with(entries: &[(u16, u32, u64, &[u8])]) -> Vec<u8> {
        let entries: Vec<Vec<u8>> = entries
            .iter()
            .map(|&(kind, arch, flags, payload)| entry(kind, arch, flags, payload, 0, 0))
            .collect();
        fatbin_of(&entries)
    }

    const H200: Arch = Arch(90);

    fn placed(data: u64, code: u64) -> Footprint {
        Footprint::Placed(Placed { data, code })
    }

    #[test]
    fn a_cubin_is_sized_by_its_global_constant_and_code_sections_only() {
        let elf = cubin_with(&[
            (".nv.global", 3 << 30),
            (".nv.global.init", 100),
            (".nv.constant0._Z4kernPc", 0x170),
            (".nv.constant3", 64),
            (".text._Z4kernPc", 512),
            (".nv.shared._Z4kernPc", 1 << 20),
            (".nv.info._Z4kernPc", 4096),
            (".symtab", 999),
        ]);
        assert!(elf.len() < 1024, "a 3 GiB module in {} bytes", elf.len());
        assert_eq!(
            footprint(&elf[..], H200),
            placed((3 << 30) + 100 + 64, 0x170 + 512)
        );
    }

    /// The sections of `__device__ char big[3ull << 30]`, a `__constant__ int[64]`, an
    /// initialised `__device__ int[4]` and one kernel, as nvcc 13.0 made them for sm_90
    /// (readelf -S on the H200 machine).
    #[test]
    fn a_cubin_from_nvcc_13_is_sized_as_its_sections_say() {
        let elf = cubin_with(&[
            (".strtab", 0x1cd),
            (".symtab", 0x388),
            (".debug_frame", 0x520),
            (".note.nv.tkinfo", 0x588),
            (".note.nv.cuinfo", 0x62c),
            (".nv.info", 0x64c),
            (".nv.compat", 0x670),
            (".nv.info.touch", 0x694),
            (".nv.callgraph", 0x20),
            (".rela.nv.constant4", 0x30),
            (".rela.debug_frame", 0x18),
            (".nv.constant4", 0x10),
            (".nv.constant3", 0x100),
            (".text.touch", 0x300),
            (".nv.global.init", 0x10),
            (".nv.shared.reserved.0", 0),
            (".nv.global", 0xc000_0000),
            (".nv.constant0.touch", 0x218),
        ]);
        assert_eq!(
            footprint(&elf[..], H200),
            placed(0x10 + 0x100 + 0x10 + 0xc000_0000, 0x300 + 0x218)
        );
    }

    #[test]
    fn a_fatbinary_is_sized_by_the_entry_the_driver_would_load() {
        let small = cubin_with(&[(".nv.global", 1 << 20)]);
        let big = cubin_with(&[(".nv.global", 3 << 30)]);
        let mid = cubin_with(&[(".nv.global", 64 << 20)]);
        let ptx = b".version 8.0\n.target sm_52\n.global .b8 g[1000];\n\0".to_vec();
        let fat = fatbin_with(&[
            (KIND_ELF, 80, 0, &small),
            (KIND_ELF, 90, 0, &big),
            (KIND_ELF, 86, 0, &mid),
            (KIND_PTX, 52, 0, &ptx),
        ]);
        // The device's own architecture first,
        assert_eq!(footprint(&fat[..], Arch(90)), placed(3 << 30, 0));
        // else the newest lower one of its major,
        assert_eq!(footprint(&fat[..], Arch(89)), placed(64 << 20, 0));
        assert_eq!(footprint(&fat[..], Arch(87)), placed(64 << 20, 0));
        // else PTX, which is compiled for it.
        assert_eq!(footprint(&fat[..], Arch(100)), placed(1000, 0));
        assert_eq!(footprint(&fat[..], Arch(75)), placed(1000, 0));
        assert_eq!(
            footprint(&fat[..], Arch(50)),
            Footprint::Unknown(Unknown::NoEntry)
        );
    }

    #[test]
    fn a_compressed_entry_is_sized_after_it_is_expanded() {
        let big = cubin_with(&[(".nv.global", 3 << 30), (".text.touch", 0x300)]);
        let small = cubin_with(&[(".nv.global", 1 << 20)]);
        let ptx =
            b".version 8.8\n.target sm_90\n.address_size 64\n.global .align 1 .b8 g[1536];\n\0";
        for packing in [Packing::Lz4, Packing::Zstd] {
            // As `nvcc -Xfatbin=-compress-all` makes them: every entry compressed.
            let fat = fatbin_of(&[
                packed_entry(KIND_ELF, 80, packing, &small),
                packed_entry(KIND_ELF, 90, packing, &big),
                packed_entry(KIND_PTX, 90, packing, ptx),
            ]);
            assert_eq!(
                footprint(&fat[..], H200),
                placed(3 << 30, 0x300),
                "{packing:?}"
            );
            assert_eq!(
                footprint(&fat[..], Arch(86)),
                placed(1 << 20, 0),
                "{packing:?}"
            );
            assert_eq!(
                footprint(&fat[..], Arch(100)),
                placed(1536, 0),
                "{packing:?}"
            );
        }
        // Not expanded where not asked to: the compressed entry only, not a stored one.
        let fat = fatbin_of(&[packed_entry(KIND_ELF, 90, Packing::Zstd, &big)]);
        let unexpanded = Footprint::Unknown(Unknown::Unexpanded);
        assert_eq!(footprint_unexpanded(&fat[..], H200), unexpanded);
        let fat = fatbin_with(&[(KIND_ELF, 90, 0x11, &big)]);
        assert_eq!(footprint_unexpanded(&fat[..], H200), placed(3 << 30, 0x300));
        // As nvcc 13 makes them by default: the PTX compressed (Zstandard), the cubins not.
        let fat = fatbin_of(&[
            packed_entry(KIND_PTX, 90, Packing::Zstd, ptx),
            entry(KIND_ELF, 90, 0x11, &big, 0, 0),
        ]);
        assert_eq!(footprint(&fat[..], H200), placed(3 << 30, 0x300));
        assert_eq!(footprint(&fat[..], Arch(100)), placed(1536, 0));
    }

    #[test]
    fn a_compressed_entry_that_does_not_expand_as_its_header_says_cannot_say() {
        let big = cubin_with(&[(".nv.global", 3 << 30)]);
        let cannot = Footprint::Unknown(Unknown::Compressed);
        let zstd = packed_entry(KIND_ELF, 90, Packing::Zstd, &big);
        let lz4 = packed_entry(KIND_ELF, 90, Packing::Lz4, &big);
        let head = |e: &[u8], at: usize, v: u64| {
            let mut e = e.to_vec();
            let n = if at == 56 { 8 } else { 4 };
            e[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
            e
        };
        for (what, e) in [
            (
                "bytes that are neither",
                entry(
                    KIND_ELF,
                    90,
                    0x8011,
                    &big,
                    big.len() as u32,
                    big.len() as u64,
                ),
            ),
            ("an LZ4 block as Zstandard", head(&lz4, 40, 0x8011)),
            ("both codecs' flags", head(&zstd, 40, 0xa011)),
            (
                "an expanded size too small (zstd)",
                head(&zstd, 56, big.len() as u64 - 1),
            ),
            (
                "an expanded size too small (lz4)",
                head(&lz4, 56, big.len() as u64 - 1),
            ),
            ("no expanded size", head(&zstd, 56, 0)),
            ("a compressed size cut short (zstd)", head(&zstd, 16, 20)),
            ("a compressed size cut short (lz4)", head(&lz4, 16, 20)),
            (
                "an LZ4 block said to expand more than LZ4 can",
                head(&lz4, 56, 1 << 27),
            ),
        ] {
            let fat = fatbin_of(&[e]);
            assert_eq!(footprint(&fat[..], H200), cannot, "{what}");
        }
        // A payload cut short inside the image: the entry ends past the fatbinary's end.
        let mut fat = fatbin_of(std::slice::from_ref(&zstd));
        fat.truncate(fat.len() - 8);
        assert!(matches!(footprint(&fat[..], H200), Footprint::Unknown(_)));
    }

    /// A header's sizes are bounded before anything is read or allocated for them: an
    /// entry saying it expands past [`MAX_UNPACKED`] is not read at all, and a Zstandard
    /// frame is not given a window (the decoder's buffer) larger than its expanded size.
    #[test]
    fn a_compressed_entry_is_not_expanded_past_the_bounds_kept_here() {
        struct Counted<'a>(&'a [u8], std::cell::Cell<u64>);
        impl Source for Counted<'_> {
            fn read(&self, at: u64, buf: &mut [u8]) -> bool {
                self.1.set(self.1.get() + buf.len() as u64);
                self.0.read(at, buf)
            }
        }
        let big = cubin_with(&[(".nv.global", 3 << 30)]);
        let mut e = packed_entry(KIND_ELF, 90, Packing::Zstd, &big);
        e[56..64].copy_from_slice(&(MAX_UNPACKED + 1).to_le_bytes());
        let fat = fatbin_of(&[e]);
        let image = Counted(&fat, std::cell::Cell::new(0));
        assert_eq!(
            footprint(&image, H200),
            Footprint::Unknown(Unknown::Compressed)
        );
        assert!(image.1.get() < 256, "{} bytes read", image.1.get());
        // One raw block of one byte in a frame whose window is 16 MiB (and no content
        // size): decoded under a window bound of 16 MiB, refused under 8 MiB (an entry
        // expanding to 1 byte); the expanded length must be the header's too.
        let frame = |window_descriptor: u8| {
            [
                0x28,
                0xb5,
                0x2f,
                0xfd,
                0x00,
                window_descriptor,
                0x09,
                0x00,
                0x00,
                b'x',
            ]
        };
        let (w8mi, w16mi) = (13 << 3, 14 << 3);
        assert_eq!(unzstd_here(&frame(w8mi), 1), Some(b"x".to_vec()));
        assert_eq!(unzstd_here(&frame(w16mi), 1), None);
        assert_eq!(unzstd_here(&frame(w8mi), 2), None);
        // The system's decoder writes into the expanded size alone (no window of its
        // own): a frame that expands to more or less than the header says is refused.
        assert_eq!(unzstd(&frame(w16mi), 1), Some(b"x".to_vec()));
        assert_eq!(unzstd(&frame(w8mi), 2), None);
        assert_eq!(unzstd(&frame(w8mi), 0), None);
    }

    /// The system's decoder, where this machine has one, and the carried one expand the
    /// same frames to the same bytes, and refuse the same damaged ones.
    #[test]
    fn the_systems_zstandard_decoder_and_the_carried_one_agree() {
        if crate::sys::zstd::decompress(&[], &mut []).is_none() {
            assert!(
                std::env::var_os("CB_REQUIRE_LIBZSTD").is_none(),
                "CB_REQUIRE_LIBZSTD is set and libzstd.so.1 cannot be loaded"
            );
            eprintln!("SKIP: no libzstd.so.1 on this machine (the carried decoder alone)");
            return;
        }
        let raw: Vec<u8> = (0..300_000u32)
            .flat_map(|i| ((i % 251) ^ (i / 7)).to_le_bytes())
            .collect();
        let frame = ruzstd::encoding::compress_to_vec(
            &raw[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        assert_eq!(unzstd(&frame, raw.len()).as_deref(), Some(&raw[..]));
        assert_eq!(unzstd_here(&frame, raw.len()).as_deref(), Some(&raw[..]));
        for (what, n) in [
            ("one byte short", raw.len() - 1),
            ("one byte more", raw.len() + 1),
        ] {
            assert_eq!(unzstd(&frame, n), None, "{what}");
            assert_eq!(unzstd_here(&frame, n), None, "{what}");
        }
        let mut damaged = frame.clone();
        let mid = damaged.len() / 2;
        damaged.truncate(mid);
        assert_eq!(unzstd(&damaged, raw.len()), None);
        assert_eq!(unzstd_here(&damaged, raw.len()), None);
    }

    #[test]
    fn ptx_is_sized_by_its_defined_globals_and_constants() {
        let ptx = b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.5\n.target sm_90\n\
            .address_size 64\n\
            .global .align 1 .b8 big[3221225472];\n\
            .visible .global .align 4 .u32 counter;\n\
            .extern .global .align 8 .b8 elsewhere[4096];\n\
            .const .align 8 .v2 .f32 pairs[2][3];\n\
            .global .u16 a, b[4] = {1, 2, 3, 4}, c[] = {1, 2, 3};\n\
            /* .global .b8 commented[1000]; */\n\
            .visible .entry k(.param .u64 .ptr .global .align 1 k_param_0)\n{\n\
            .reg .b64 %rd<3>;\n ld.global.u32 %r1, [counter];\n ret;\n}\n";
        let expected = 3221225472 + 4 + 8 * 6 + 2 * (1 + 4 + 3);
        assert_eq!(footprint(&ptx[..], H200), placed(expected, 0));
    }

    #[test]
    fn comments_in_ptx_hide_what_they_say_and_nothing_after_them() {
        let ptx = b".version 8.5\n.target sm_90\n.address_size 64\n\
            .global .align 4 .u32 before;  // .global .b8 fake[1000000];\n\
            .global .align 1 .b8 after[4096];\n\
            /* .const .b8 fake_too[1000000]; */ .const .align 8 .b8 last[64];\n\
            .global .align 8 .b8 very_last[8];\n\
            .extern /* the end;*/ .global .align 1 .b8 elsewhere[4096];\n";
        assert_eq!(footprint(&ptx[..], H200), placed(4 + 4096 + 64 + 8, 0));
    }

    #[test]
    fn an_unknown_format_says_so() {
        for image in [&b"fake image"[..], b"", b"\x7fELF", &[0xffu8; 200][..]] {
            assert!(
                matches!(footprint(image, H200), Footprint::Unknown(_)),
                "{image:?}"
            );
        }
        let mut wrapper = [0u8; 24];
        wrapper[..4].copy_from_slice(&WRAPPER_MAGIC.to_le_bytes());
        wrapper[8..16].copy_from_slice(&0x1234u64.to_le_bytes());
        assert_eq!(wrapped(&wrapper[..]), Some(0x1234));
        assert_eq!(wrapped(&b"\x7fELF"[..]), None);
    }

    /// An image of another format, however long, is read no further than its first
    /// bytes (each read may be a system call, and a copy).
    #[test]
    fn another_format_is_not_read_past_its_first_bytes() {
        struct Endless(std::cell::Cell<u64>);
        impl Source for Endless {
            fn read(&self, _at: u64, buf: &mut [u8]) -> bool {
                self.0.set(self.0.get() + buf.len() as u64);
                buf.fill(0xee);
                true
            }
        }
        let image = Endless(std::cell::Cell::new(0));
        assert_eq!(footprint(&image, H200), Footprint::Unknown(Unknown::Format));
        assert!(image.0.get() <= 1 << 17, "{} bytes read", image.0.get());
    }

    /// Random bytes, and valid images cut, flipped and grown at random: never a panic,
    /// never a read outside the image (the slice source would refuse it, not crash, but
    /// the bounds are checked here too by the window).
    #[test]
    fn any_bytes_are_read_without_a_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let elf = cubin_with(&[(".nv.global", 3 << 30), (".text.k", 64)]);
        let ptx = b".version 8.0\n.target sm_90\n.global .b8 g[1000];\n".to_vec();
        let fat = fatbin_with(&[(KIND_ELF, 90, 0, &elf), (KIND_PTX, 90, 0, &ptx)]);
        let lz4 = fatbin_of(&[
            packed_entry(KIND_ELF, 90, Packing::Lz4, &elf),
            packed_entry(KIND_PTX, 90, Packing::Lz4, &ptx),
        ]);
        let zstd = fatbin_of(&[
            packed_entry(KIND_ELF, 90, Packing::Zstd, &elf),
            packed_entry(KIND_PTX, 90, Packing::Zstd, &ptx),
        ]);
        let seeds = [elf, ptx, fat, lz4, zstd];
        // IMAGE_FUZZ_ROUNDS: more rounds than CI's, by hand.
        let rounds = std::env::var("IMAGE_FUZZ_ROUNDS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(20_000);
        for round in 0..rounds {
            let mut image = if round % 4 == 0 {
                (0..next() % 512).map(|_| next() as u8).collect()
            } else {
                seeds[round % seeds.len()].clone()
            };
            for _ in 0..next() % 8 {
                if image.is_empty() {
                    break;
                }
                let at = (next() as usize) % image.len();
                match next() % 4 {
                    0 => image.truncate(at),
                    1 => image[at] = next() as u8,
                    2 => image[at] ^= 0xff,
                    _ => image.extend((0..next() % 64).map(|_| next() as u8)),
                }
            }
            let arch = Arch((next() % 130) as u32);
            let _ = footprint(&image[..], arch);
            let _ = wrapped(&image[..]);
        }
    }
}
