//! Graph memory: what memory nodes (captured `cuMemAllocAsync`, `cuGraphAddMemAllocNode`)
//! cost the device. The driver reserves it for the device's graphs at upload or launch,
//! from a pool of its own; `cuDeviceGetGraphMemAttribute(RESERVED_MEM_CURRENT)` says how
//! much it holds, and that figure is charged to the device, like the stream-ordered
//! pools' reserve.
//!
//! At instantiation the library adds up each executable graph's memory nodes (its
//! footprint, per device). Before an upload or launch of one that has any, the growth
//! the launch could cause — what the graphs use now plus the footprint, less what is
//! reserved — is admitted against the budget; after it, the driver's figure replaces the
//! estimate. Graphs without memory nodes, the vast majority, cost one load per launch.
//!
//! A graph's free nodes may also free blocks from outside it (a `cuMemFreeAsync`
//! captured into it, or `cuGraphAddMemFreeNode` of such a block). Those frees happen when
//! the graph is launched, so that is when the library forgets the blocks: their charge
//! goes back as a stream-ordered free's would, and an address the driver hands out again
//! later finds no stale record.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::admit::capture;
use crate::books::ledger::{DeviceLedger, MAX_DEVICES};
use crate::sys::driver::{
    DevicePtr, GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, GRAPH_MEM_ATTR_USED_MEM_CURRENT,
    GRAPH_NODE_TYPE_GRAPH, GRAPH_NODE_TYPE_MEM_ALLOC, GRAPH_NODE_TYPE_MEM_FREE, Graph, GraphExec,
    GraphNode, MemAllocNodeParams, Opaque, real,
};
use crate::sys::lock::Lock;

/// The granularity a memory node is rounded up to (the driver's 2 MiB pages).
const NODE_GRANULARITY: u64 = 2 << 20;
/// How deep child graphs are searched for memory nodes.
const MAX_DEPTH: u32 = 8;

/// Memory nodes of one executable graph: `(device, bytes)` per device.
pub type Footprint = Vec<(usize, u64)>;

/// What one executable graph does with device memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecMemory {
    /// Its memory nodes, per device.
    pub footprint: Footprint,
    /// Blocks from outside the graph that its free nodes free at each launch.
    pub frees: Vec<DevicePtr>,
}

impl ExecMemory {
    fn is_empty(&self) -> bool {
        self.footprint.is_empty() && self.frees.is_empty()
    }
}

/// Executable graphs that have memory nodes or free nodes, by handle.
static EXECS: Lock<BTreeMap<usize, ExecMemory>> = Lock::new(BTreeMap::new());
/// How many there are: while none, a launch looks at nothing else.
static WITH_MEMORY: AtomicUsize = AtomicUsize::new(0);

/// What each device is charged for graph memory, and under which books
/// ([`DeviceLedger::books_epoch`]): a charge from before the books were cleared is gone.
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static CHARGED_BOOKS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Held while a device's charge is re-read and applied.
static SETTLING: Lock<()> = Lock::new(());

/// Adds up the memory nodes of `graph` (and of its child graphs), per device, and lists
/// what its free nodes free that its memory nodes did not allocate.
pub fn memory_of(graph: Graph) -> ExecMemory {
    let mut memory = ExecMemory::default();
    let mut own = Vec::new();
    capture::relaxed(|| add_nodes(graph, 0, &mut memory, &mut own));
    memory.frees.retain(|ptr| !own.contains(ptr));
    memory.frees.sort_unstable();
    memory.frees.dedup();
    memory
}

fn add_nodes(graph: Graph, depth: u32, memory: &mut ExecMemory, own: &mut Vec<DevicePtr>) {
    let mut count = 0usize;
    // SAFETY: a graph handle from the driver; NULL nodes asks for the count.
    if !unsafe { real::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }.is_ok()
        || count == 0
    {
        return;
    }
    let mut nodes = vec![GraphNode::NULL; count];
    // SAFETY: room for `count` nodes; the driver writes at most that many.
    if !unsafe { real::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }.is_ok() {
        return;
    }
    nodes.truncate(count);
    for node in nodes {
        let mut kind: c_int = -1;
        // SAFETY: a node handle the driver just gave.
        if !unsafe { real::cuGraphNodeGetType(node, &mut kind) }.is_ok() {
            continue;
        }
        if kind == GRAPH_NODE_TYPE_MEM_ALLOC {
            // SAFETY: all-zero is a valid value of this plain C struct.
            let mut params: MemAllocNodeParams = unsafe { std::mem::zeroed() };
            // SAFETY: a memory-allocation node and a struct of the driver's layout.
            if unsafe { real::cuGraphMemAllocNodeGetParams(node, &mut params) }.is_ok()
                && params.pool.location.id >= 0
            {
                let bytes = (params.bytes as u64).div_ceil(NODE_GRANULARITY) * NODE_GRANULARITY;
                add(
                    &mut memory.footprint,
                    params.pool.location.id as usize,
                    bytes,
                );
                own.push(params.dptr);
            }
        } else if kind == GRAPH_NODE_TYPE_MEM_FREE {
            let mut ptr: DevicePtr = 0;
            // SAFETY: a memory-free node; the driver writes the address it frees.
            if unsafe { real::cuGraphMemFreeNodeGetParams(node, &mut ptr) }.is_ok() && ptr != 0 {
                memory.frees.push(ptr);
            }
        } else if kind == GRAPH_NODE_TYPE_GRAPH && depth < MAX_DEPTH {
            let mut child = Graph::NULL;
            // SAFETY: a child-graph node; the driver writes the graph it embeds.
            if unsafe { real::cuGraphChildGraphNodeGetGraph(node, &mut child) }.is_ok() {
                add_nodes(child, depth + 1, memory, own);
            }
        }
    }
}

fn add(footprint: &mut Footprint, device: usize, bytes: u64) {
    match footprint.iter_mut().find(|(d, _)| *d == device) {
        Some((_, total)) => *total = total.saturating_add(bytes),
        None => footprint.push((device, bytes)),
    }
}

/// `exec` was instantiated with this memory.
pub fn instantiated(exec: GraphExec, memory: ExecMemory) {
    if memory.is_empty() || exec.is_null() {
        return;
    }
    let mut execs = EXECS.lock();
    if execs.insert(exec.key(), memory).is_none() {
        WITH_MEMORY.store(execs.len(), Ordering::Release);
    }
}

/// `exec` was destroyed.
pub fn destroyed(exec: GraphExec) {
    if WITH_MEMORY.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut execs = EXECS.lock();
    if execs.remove(&exec.key()).is_some() {
        WITH_MEMORY.store(execs.len(), Ordering::Release);
    }
}

/// What `exec` does with memory, if it has memory or free nodes.
#[inline]
pub fn memory(exec: GraphExec) -> Option<ExecMemory> {
    if WITH_MEMORY.load(Ordering::Acquire) == 0 {
        return None;
    }
    EXECS.lock().get(&exec.key()).cloned()
}

/// The device's graph memory, by the driver: `(used, reserved)`.
pub fn read(device: usize) -> Option<(u64, u64)> {
    let attribute = |attr| {
        let mut value = 0u64;
        // SAFETY: both attributes are a cuuint64_t written to `value`.
        let rc = unsafe {
            real::cuDeviceGetGraphMemAttribute(
                device as c_int,
                attr,
                (&mut value as *mut u64).cast(),
            )
        };
        rc.is_ok().then_some(value)
    };
    capture::relaxed(|| {
        Some((
            attribute(GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
            attribute(GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
        ))
    })
}

/// What the device is charged for graph memory now.
pub fn charged(device: usize, d: &DeviceLedger) -> u64 {
    let (Some(charged), Some(books)) = (CHARGED.get(device), CHARGED_BOOKS.get(device)) else {
        return 0;
    };
    if books.load(Ordering::Acquire) == d.books_epoch() {
        charged.load(Ordering::Acquire)
    } else {
        0
    }
}

/// Charges the device what its graphs hold now, by the driver's figure; false when the
/// driver could not say (nothing changed).
pub fn settle(device: usize, d: &DeviceLedger) -> bool {
    if device >= MAX_DEVICES {
        return false;
    }
    let _settling = SETTLING.lock();
    let Some((_, reserved)) = read(device) else {
        return false;
    };
    let before = charged(device, d);
    CHARGED[device].store(reserved, Ordering::Release);
    CHARGED_BOOKS[device].store(d.books_epoch(), Ordering::Release);
    super::after::charge_after(d, before, reserved);
    true
}

/// Gives back what the device's graphs hold but do not use (before a denial), and
/// charges what is left.
pub fn trim(device: usize, d: &DeviceLedger) {
    if charged(device, d) == 0 {
        return;
    }
    // SAFETY: a device ordinal is its handle.
    let _ = capture::relaxed(|| unsafe { real::cuDeviceGraphMemTrim(device as c_int) });
    settle(device, d);
}

/// In the child of `fork()`: no graphs came along, and no lock is held.
///
/// # Safety
/// Only from an at-fork child handler.
pub unsafe fn reset_in_child() {
    // SAFETY: the caller's guarantee.
    unsafe {
        EXECS.reset_in_child(BTreeMap::new());
        SETTLING.reset_in_child(());
    }
    WITH_MEMORY.store(0, Ordering::Release);
    for charged in &CHARGED {
        charged.store(0, Ordering::Release);
    }
}
