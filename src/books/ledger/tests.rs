use super::addresses::*;
use super::credit::*;
use super::entries::*;
use super::lanes::*;
use super::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    /// The lanes this test thread's removals opened (bit L for lane L).
    static OPENED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// What the library's `gate::open_lane` is to a removal: here, a record of it.
fn record_open(lane: usize) {
    OPENED.with(|o| o.set(o.get() | 1 << lane));
}

/// The lanes opened since the last call.
fn opened() -> u32 {
    OPENED.with(|o| o.replace(0))
}

fn device(budget: u64) -> DeviceLedger {
    let d = DeviceLedger::new();
    d.set_budget(Budget::Bytes(budget));
    d
}

#[test]
fn a_reservation_is_measured_against_the_budget_in_force_it_is_given() {
    let d = device(100);
    let resolved = d.in_force();
    assert_eq!(resolved.bytes, 100);
    // A budget raised after the call was resolved: the call keeps what it was given,
    // the next call gets the new one.
    d.set_budget(Budget::Bytes(200));
    assert_eq!(d.reserve(150, resolved).err().map(|e| e.budget), Some(100));
    d.reserve(150, d.in_force()).unwrap().commit();
    assert_eq!(d.used(), 150);
}

#[test]
fn a_reservation_that_fits_is_charged_and_one_that_does_not_is_refused() {
    let d = device(100);
    d.reserve(60, d.in_force()).unwrap().commit();
    assert_eq!(d.used(), 60);
    let denial = d.reserve(41, d.in_force()).err().unwrap();
    assert_eq!(
        denial,
        Denial {
            requested: 41,
            used: 60,
            budget: 100
        }
    );
    d.reserve(40, d.in_force()).unwrap().commit();
    assert_eq!(d.used(), 100);
    assert_eq!(d.peak(), 100);
}

/// The synchronous fast path's reservation: what fits the device's own budget, with
/// its peak; nothing taken for what does not fit, for a budget not worked out or none,
/// and in a job (whose books the full path keeps).
#[test]
fn a_reservation_on_the_fast_path_fits_the_devices_own_budget_or_takes_nothing() {
    let d = device(100);
    d.reserve_own(60).unwrap().commit();
    assert_eq!((d.used(), d.peak()), (60, 60));
    assert!(d.reserve_own(41).is_none(), "past the budget");
    assert_eq!(d.used(), 60, "nothing taken");
    drop(d.reserve_own(40).unwrap());
    assert_eq!((d.used(), d.peak()), (60, 100), "dropped: given back");
    assert!(d.reserve_own(u64::MAX).is_none(), "no overflow");
    for budget in [Budget::Unresolved, Budget::Unbudgeted] {
        d.set_budget(budget);
        assert!(d.reserve_own(1).is_none(), "{budget:?}: the full path's");
    }
    assert_eq!(d.used(), 60);
    d.set_budget(Budget::Bytes(1000));
    d.join_job(0);
    assert!(d.reserve_own(1).is_none(), "a job's: the full path's");
    assert_eq!(d.used(), 60);
}

/// The synchronous fast path's release: the bytes back, stopping at zero; in a job
/// nothing is given here (the full path gives the job's books theirs too).
#[test]
fn a_release_on_the_fast_path_stops_at_zero_and_leaves_a_jobs_books_to_the_full_path() {
    let d = device(100);
    d.reserve_own(60).unwrap().commit();
    assert!(d.release_alone(20));
    assert_eq!(d.used(), 40);
    assert!(d.release_alone(50));
    assert_eq!(d.used(), 0, "never below zero");
    d.reserve_own(30).unwrap().commit();
    d.join_job(0);
    assert!(!d.release_alone(30));
    assert_eq!(d.used(), 30, "nothing given");
}

#[test]
fn a_reservation_past_the_budget_is_charged_and_rolled_back_like_any_other() {
    let d = device(100);
    d.reserve(60, d.in_force()).unwrap().commit();
    d.reserve_past_budget(70).commit();
    assert_eq!((d.used(), d.peak()), (130, 130));
    assert!(
        d.reserve(1, d.in_force()).is_err(),
        "above the budget, what fits is still decided"
    );
    drop(d.reserve_past_budget(50));
    assert_eq!(d.used(), 130, "not committed: given back");
    d.note_overrun();
    assert_eq!(d.overruns(), 1);
}

#[test]
fn a_dropped_reservation_is_rolled_back() {
    let d = device(100);
    {
        let _r = d.reserve(70, d.in_force()).unwrap();
        assert_eq!(d.used(), 70);
    }
    assert_eq!(d.used(), 0);
}

#[test]
fn releases_never_take_the_counter_below_zero() {
    let d = device(100);
    d.reserve(10, d.in_force()).unwrap().commit();
    d.release(1 << 60);
    assert_eq!(d.used(), 0);
    d.release(5);
    assert_eq!(d.used(), 0);
}

#[test]
fn a_request_that_overflows_is_refused() {
    let d = device(u64::MAX);
    d.reserve(10, d.in_force()).unwrap().commit();
    assert!(d.reserve(u64::MAX, d.in_force()).is_err());
}

#[test]
fn racing_threads_never_pass_the_budget_together() {
    let d = Arc::new(device(1000));
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                let mut held = 0;
                while let Ok(r) = d.reserve(7, d.in_force()) {
                    r.commit();
                    held += 7;
                }
                held
            })
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(total <= 1000);
    assert!(total > 1000 - 7);
    assert_eq!(d.used(), total);
    assert_eq!(d.peak(), total);
}

#[test]
fn overhead_moves_used_by_the_difference() {
    let d = device(1000);
    d.reserve(100, d.in_force()).unwrap().commit();
    d.set_overhead(300);
    assert_eq!(d.used(), 400);
    d.set_overhead(50);
    assert_eq!(d.used(), 150);
    assert_eq!(d.overhead(), 50);
}

#[test]
fn the_table_finds_what_was_inserted_and_nothing_else() {
    let t: AddrTable<1024> = AddrTable::new();
    let e = Entry {
        bytes: 4096,
        device: 3,
        kind: Kind::Pooled,
    };
    t.insert(0x7f00_0000_0000, e);
    assert_eq!(t.remove(0x7f00_0020_0000), None);
    assert_eq!(t.remove(0x7f00_0000_0000), Some(e));
    assert_eq!(t.remove(0x7f00_0000_0000), None);
}

#[test]
fn the_table_spills_to_overflow_when_a_window_is_full() {
    let t: AddrTable<64> = AddrTable::new();
    let keys: Vec<u64> = (1..=200u64).map(|k| k << 21).collect();
    for (i, &k) in keys.iter().enumerate() {
        t.insert(
            k,
            Entry {
                bytes: i as u64 + 1,
                device: 0,
                kind: Kind::Direct,
            },
        );
    }
    // 64 slots for 200 keys: at least the rest went to the overflow map.
    assert!(t.overflow_len.load(Ordering::Relaxed) >= 200 - 64);
    for (i, &k) in keys.iter().enumerate() {
        assert_eq!(t.remove(k).map(|e| e.bytes), Some(i as u64 + 1));
    }
    assert_eq!(t.overflow_len.load(Ordering::Relaxed), 0);
}

#[test]
fn purging_a_device_drops_only_its_entries() {
    let t: AddrTable<1024> = AddrTable::new();
    for (k, dev) in [(1u64 << 21, 0), (2 << 21, 1), (3 << 21, 0)] {
        t.insert(
            k,
            Entry {
                bytes: 1,
                device: dev,
                kind: Kind::Direct,
            },
        );
    }
    t.purge_device(0);
    assert_eq!(t.remove(1 << 21), None);
    assert_eq!(t.remove(3 << 21), None);
    assert!(t.remove(2 << 21).is_some());
}

fn pooled(bytes: u64) -> Entry {
    Entry {
        bytes,
        device: 0,
        kind: Kind::Pooled,
    }
}

/// Lanes are process-wide: the tests that claim them take turns.
static LANE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn lanes_are_given_once_lowest_first_and_come_back() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let a = claim_lane();
    let b = claim_lane();
    assert!((1..LANES).contains(&a) && (1..LANES).contains(&b) && a != b);
    release_lane(a);
    let c = claim_lane();
    assert_eq!(c, a, "the lowest free lane is given first");
    release_lane(b);
    release_lane(c);
    // Lane 0 is nobody's: releasing it changes nothing.
    release_lane(0);
    assert_eq!(LANES_TAKEN.load(Ordering::Relaxed) & 1, 1);
}

#[test]
fn a_lane_holds_a_bucket_of_entries_and_the_map_takes_the_rest() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let lane = claim_lane();
    let other = claim_lane();
    static T: LaneTable<64> = LaneTable::new();
    // Keys of one bucket: a lane has room for BUCKET of them.
    let bucket = Region::<64>::bucket_index(1 << 21);
    let same: Vec<u64> = (1..100_000u64)
        .map(|k| k << 12)
        .filter(|&k| Region::<64>::bucket_index(k) == bucket)
        .take(BUCKET + 1)
        .collect();
    for (i, &k) in same[..BUCKET].iter().enumerate() {
        assert!(T.insert(k, pooled(i as u64), lane));
    }
    assert!(
        !T.insert(same[BUCKET], pooled(9), lane),
        "the bucket is full"
    );
    assert!(
        !T.insert(same[BUCKET], pooled(9), 0),
        "lane 0 never fills a slot"
    );
    assert!(
        T.insert(same[BUCKET], pooled(9), other),
        "another lane has room"
    );
    // Found from any lane's point of view, once; a lane is opened before a block is
    // taken from it by a thread that does not hold it, and only then.
    opened();
    assert_eq!(T.remove(same[1], lane, record_open), Some(pooled(1)));
    assert_eq!(opened(), 0, "its own lane is not opened");
    assert_eq!(T.remove(same[1], lane, record_open), None);
    assert_eq!(opened(), 0, "nor one where nothing is found");
    assert_eq!(T.remove(same[2], other, record_open), Some(pooled(2)));
    assert_eq!(opened(), 1 << lane, "the lane it was taken from");
    assert_eq!(T.remove(same[BUCKET], 0, record_open), Some(pooled(9)));
    assert_eq!(opened(), 1 << other);
    assert!(T.insert(same[BUCKET], pooled(7), lane));
    assert_eq!(T.remove(same[BUCKET], other, record_open), Some(pooled(7)));
    assert_eq!(opened(), 1 << lane);

    static M: PointerMap = PointerMap::new();
    let keys: Vec<u64> = (1..100_000u64)
        .map(|k| k << 12)
        .filter(|&k| Region::<4096>::bucket_index(k) == 0)
        .take(BUCKET + 2)
        .collect();
    for (i, &k) in keys.iter().enumerate() {
        M.insert_in_lane(k, pooled(i as u64), lane);
    }
    M.insert_in_lane(0x7000_0000, pooled(99), 0);
    for (i, &k) in keys.iter().enumerate().rev() {
        assert_eq!(
            M.remove_pooled(k, other, record_open),
            Some(pooled(i as u64))
        );
    }
    assert_eq!(
        Table::remove(&M, 0x7000_0000, record_open),
        Some(pooled(99))
    );
    assert_eq!(Table::remove(&M, 0x7000_0000, record_open), None);
    release_lane(lane);
    release_lane(other);
}

#[test]
fn a_lane_given_again_keeps_its_old_threads_blocks() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    static M: PointerMap = PointerMap::new();
    // A thread allocates, then exits with its blocks still live.
    let first = std::thread::spawn(|| {
        let lane = claim_lane();
        for k in 1..=1000u64 {
            M.insert_in_lane(k << 16, pooled(k), lane);
        }
        release_lane(lane);
        lane
    })
    .join()
    .unwrap();
    // The next thread gets the same lane and fills it too.
    let second = std::thread::spawn(|| {
        let lane = claim_lane();
        for k in 1001..=2000u64 {
            M.insert_in_lane(k << 16, pooled(k), lane);
        }
        lane
    })
    .join()
    .unwrap();
    assert_eq!(first, second);
    for k in 1..=2000u64 {
        assert_eq!(
            M.remove_pooled(k << 16, 0, record_open),
            Some(pooled(k)),
            "{k}"
        );
    }
    release_lane(second);
}

#[test]
fn blocks_freed_by_other_threads_are_found_once_each() {
    // Eight threads allocate with their own lanes; each block is freed by the next
    // thread, as PyTorch's autograd thread frees what the forward pass allocated.
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    // (A static: the map is too large for a test thread's stack.)
    static M: PointerMap = PointerMap::new();
    const PER: u64 = 20_000;
    let (tx, rx): (Vec<_>, Vec<_>) = (0..8).map(|_| std::sync::mpsc::channel()).unzip();
    let mut rx: Vec<Option<std::sync::mpsc::Receiver<u64>>> = rx.into_iter().map(Some).collect();
    let handles: Vec<_> = (0..8usize)
        .map(|t| {
            let m = &M;
            let to_next = tx[(t + 1) % 8].clone();
            let mine = rx[t].take().unwrap();
            std::thread::spawn(move || {
                let lane = claim_lane();
                let mut found = 0u64;
                for i in 0..PER {
                    let key = ((t as u64) << 40) | ((i + 1) << 8);
                    m.insert_in_lane(key, pooled(key & 0xffff_ffff), lane);
                    to_next.send(key).unwrap();
                    while let Ok(k) = mine.try_recv() {
                        assert_eq!(
                            m.remove_pooled(k, lane, record_open),
                            Some(pooled(k & 0xffff_ffff))
                        );
                        found += 1;
                    }
                }
                drop(to_next);
                release_lane(lane);
                (found, mine)
            })
        })
        .collect();
    drop(tx);
    let mut total = 0;
    for h in handles {
        let (found, mine) = h.join().unwrap();
        total += found;
        for k in mine.iter() {
            assert_eq!(
                M.remove_pooled(k, 0, record_open),
                Some(pooled(k & 0xffff_ffff))
            );
            total += 1;
        }
    }
    assert_eq!(total, 8 * PER);
}

/// Two threads freeing one block at once (a double free: the driver refuses one): of
/// their removals exactly one gets the entry, in a lane's region and in the shared table.
/// Were both to get it, the one whose free is refused would put back an entry no charge
/// stands behind, which a later free would give back a second time.
#[test]
fn of_two_threads_taking_one_entry_at_once_exactly_one_gets_it() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    static M: PointerMap = PointerMap::new();
    static A: AddrTable<{ 1 << 14 }> = AddrTable::new();
    const ROUNDS: u64 = 2000;
    const BATCH: u64 = 2048;
    let lane = claim_lane();
    let region = M.own_region(lane).unwrap();
    // This thread records a batch of entries each round, then starts both racers at once
    // (they spin on the round's number); they take the whole batch in the same order, so
    // that they meet on its slots again and again.
    let started = AtomicU64::new(u64::MAX);
    let done = std::sync::Barrier::new(3);
    let keys = |round: u64| (round * BATCH + 1..=(round + 1) * BATCH).map(|k| k << 12);
    let (region_wins, table_wins) = std::thread::scope(|s| {
        let racers = [(); 2].map(|()| {
            s.spawn(|| {
                let mut wins = (0u64, 0u64);
                for round in 0..ROUNDS {
                    while started.load(Ordering::Acquire) != round {
                        std::hint::spin_loop();
                    }
                    for key in keys(round) {
                        wins.0 += region.take(key).is_some() as u64;
                    }
                    for key in keys(round) {
                        wins.1 += A.remove(key).is_some() as u64;
                    }
                    done.wait();
                }
                wins
            })
        });
        // Counted, not asserted here: a panic would leave the racers spinning.
        let mut recorded = 0;
        for round in 0..ROUNDS {
            for key in keys(round) {
                recorded += region.insert(key, pooled(key)) as u64;
                A.insert(key, pooled(key));
            }
            started.store(round, Ordering::Release);
            done.wait();
        }
        let wins = racers
            .map(|r| r.join().unwrap())
            .into_iter()
            .fold((0, 0), |(r, t), (a, b)| (r + a, t + b));
        assert_eq!(recorded, ROUNDS * BATCH, "every entry had room");
        wins
    });
    const ROUNDS_X_BATCH: u64 = ROUNDS * BATCH;
    assert_eq!(
        region_wins, ROUNDS_X_BATCH,
        "one taker per entry of a region"
    );
    assert_eq!(
        table_wins, ROUNDS_X_BATCH,
        "one per entry of the shared table"
    );
    release_lane(lane);
}

#[test]
fn sizes_up_to_64_pib_and_every_device_survive_packing() {
    for (bytes, device) in [(0, 0), (1, 63), (SIZE_MASK, 17)] {
        for kind in [Kind::Direct, Kind::Pooled] {
            let e = Entry {
                bytes,
                device,
                kind,
            };
            assert_eq!(Entry::unpack(e.pack()), e);
        }
    }
}

#[test]
fn pool_credit_is_taken_from_the_shard_and_a_dry_shard_owes_nothing() {
    let p = PoolCredit::new();
    // Nothing charged yet: the first allocation finds no credit, and owes nothing
    // until it debits the bank itself.
    assert!(!p.take(0, 100));
    let mut bank = p.collect();
    assert_eq!(bank.credit(), 0);
    bank.debit(100);
    assert_eq!(bank.credit(), -100);
    // The caller grows the pool by 32 units and charges them.
    assert_eq!(bank.set_charge(132), 132);
    assert_eq!(bank.credit(), 32);
    bank.lend(0);
    drop(bank);
    assert!(p.take(0, 30));
    assert!(!p.take(0, 30)); // 2 left, nothing owed
    let bank = p.collect();
    assert_eq!(bank.credit(), 2);
}

/// Runs `f` while another thread keeps trying to take 1 GiB from `shard` of `p`, which
/// holds nothing: every one of those takes must fail.
fn while_large_takes_fail<R>(p: &Arc<PoolCredit>, shard: usize, f: impl FnOnce() -> R) -> R {
    let stop = Arc::new(AtomicU64::new(0));
    let big = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            while stop.load(Ordering::Relaxed) == 0 {
                assert!(!p.take(shard, 1 << 30));
            }
        })
    };
    let result = f();
    stop.store(1, Ordering::Relaxed);
    big.join().unwrap();
    result
}

#[test]
fn a_failed_take_never_leaves_credit_another_thread_can_spend() {
    // Nothing is charged, so no take may ever succeed. One thread keeps failing a
    // large take, one gathers the shards (as every growth, trim and denial does), one
    // tries small takes on the same shard. A take that subtracted and then added
    // back, with a gathering in between, left its request's size in the shard as
    // credit the small takes could spend: an allocation no growth was admitted for.
    let p = Arc::new(PoolCredit::new());
    let spent = while_large_takes_fail(&p, 3, || {
        let stop = Arc::new(AtomicU64::new(0));
        let gather = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                while stop.load(Ordering::Relaxed) == 0 {
                    drop(p.collect());
                }
            })
        };
        let mut spent = 0u64;
        for _ in 0..200_000 {
            if p.take(3, 4096) {
                spent += 1;
                p.give(3, 4096);
            }
        }
        stop.store(1, Ordering::Relaxed);
        gather.join().unwrap();
        spent
    });
    assert_eq!(spent, 0, "takes paid with credit nobody charged");
    assert_eq!(p.collect().credit(), 0);
}

#[test]
fn a_gathering_never_sees_a_failed_take_as_a_debt() {
    // Nothing is charged and nothing is taken, so every gathering must find the
    // shards empty. A deficit found there is settled as an allocation on its way to
    // the driver and charged (flow::settle_charge), with no admission against
    // the budget: a failed 1020 MiB take that a gathering caught, between its
    // subtraction and its undo, was once charged that way, and its own request then
    // spent the charge (docs/soaks/2026-12-02 at 258b938, 884 MiB over a 1 GiB budget).
    let p = Arc::new(PoolCredit::new());
    let debts = while_large_takes_fail(&p, 5, || {
        (0..200_000).filter(|_| p.collect().credit() != 0).count()
    });
    assert_eq!(debts, 0, "gatherings that saw a failed take as a debt");
}

#[test]
fn frees_return_credit_to_the_freeing_thread_and_collect_finds_it() {
    let p = PoolCredit::new();
    {
        let mut bank = p.collect();
        bank.set_charge(1000);
    }
    // One thread allocates everything, another frees it.
    assert!(!p.take(1, 1000));
    {
        let mut bank = p.collect();
        bank.debit(1000);
        assert_eq!(bank.credit(), 0);
        bank.lend(1);
    }
    p.give(2, 1000);
    let bank = p.collect();
    assert_eq!(bank.credit(), 1000);
}

#[test]
fn racing_pool_allocations_keep_the_books_balanced() {
    let p = Arc::new(PoolCredit::new());
    {
        let mut bank = p.collect();
        bank.set_charge(10_000);
    }
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                for _ in 0..10_000 {
                    if !p.take(t, 10) {
                        let mut bank = p.collect();
                        bank.debit(10);
                        if bank.credit() < 0 {
                            bank.refund(10);
                            continue;
                        }
                        bank.lend(t);
                    }
                    p.give(t, 10);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let bank = p.collect();
    assert_eq!(bank.credit(), 10_000);
}

#[test]
fn every_ordinal_up_to_the_highest_has_books_and_none_beyond() {
    static L: Ledger = Ledger::new();
    let top = crate::config::MAX_ORDINAL as usize;
    assert!(L.device(top).is_some());
    assert!(L.device(top + 1).is_none());
    assert_eq!(L.devices().count(), top + 1);
}

#[test]
fn denials_count_from_zero_and_each_note_returns_the_new_count() {
    let d = device(100);
    assert_eq!(d.denials(), 0);
    assert_eq!(d.note_denial(), 1);
    assert_eq!(d.note_denial(), 2);
    assert_eq!(d.denials(), 2);
}

#[test]
fn a_growing_overhead_charges_only_its_growth() {
    let d = device(1000);
    d.set_overhead(100);
    d.set_overhead(300);
    assert_eq!(d.used(), 300);
    assert_eq!(d.peak(), 300);
    assert_eq!(d.overhead(), 300);
}

#[test]
fn only_clearing_the_books_starts_new_books() {
    let d = device(1000);
    let first = d.epoch();
    assert_eq!(d.books_epoch(), 0);
    assert!(d.same_books(first));
    // The pools shrank: kept credit must be checked, but the books are the same.
    d.retire_credit();
    let retired = d.epoch();
    assert_ne!(retired, first);
    assert_eq!(d.books_epoch(), 0);
    assert!(d.same_books(first));
    assert!(d.same_books(retired));
    // The device's memory went with its context: credit from before is void.
    d.clear();
    assert_ne!(d.epoch(), retired);
    assert_eq!(d.books_epoch(), 1);
    assert!(!d.same_books(first));
    assert!(!d.same_books(retired));
    assert!(d.same_books(d.epoch()));
    d.retire_credit();
    assert!(d.same_books(d.epoch()));
    d.clear();
    assert_eq!(d.books_epoch(), 2);
}

#[test]
fn a_reservation_the_clear_wiped_is_charged_again_when_committed() {
    let d = device(1000);
    let r = d.reserve(100, d.in_force()).unwrap();
    // The device's last context went away while the driver allocated in another.
    d.clear();
    assert_eq!(d.used(), 0);
    r.commit();
    assert_eq!(d.used(), 100, "the allocation is held: it is charged");
}

#[test]
fn a_reservation_dropped_after_a_clear_gives_back_nothing_of_the_new_books() {
    let d = device(1000);
    let r = d.reserve(100, d.in_force()).unwrap();
    d.clear();
    d.reserve(50, d.in_force()).unwrap().commit();
    drop(r);
    assert_eq!(d.used(), 50, "the 50 charged after the clear stay");
}

/// A context's teardown purges the tables before it clears the books: a free that took
/// its entry out before the purge and whose driver call failed must not put it back, so
/// the clear is under way from the purge on.
#[test]
fn a_clear_is_under_way_from_the_work_before_it() {
    let d = device(1000);
    let mark = clears();
    let mut during = None;
    d.clear_after(&mut || {
        assert!(!no_clear_since(mark), "a mark from before");
        during = Some(clears());
    });
    assert!(
        !no_clear_since(during.unwrap()),
        "a mark taken while it was under way"
    );
}

#[test]
fn a_free_that_straddles_a_clear_is_told_so() {
    let d = device(1000);
    let mark = clears();
    d.clear();
    assert!(!no_clear_since(mark));
    // A mark taken while a clear is under way never passes, even once it has ended.
    CLEARS.fetch_add(CLEAR_STARTED | CLEAR_UNDER_WAY, Ordering::SeqCst);
    let during = clears();
    CLEARS.fetch_sub(CLEAR_UNDER_WAY, Ordering::SeqCst);
    assert!(!no_clear_since(during), "a mark taken during a clear");
}

#[test]
fn clearing_forgets_what_the_device_held_but_keeps_budget_and_statistics() {
    let d = device(1000);
    d.reserve(100, d.in_force()).unwrap().commit();
    d.set_overhead(50);
    {
        let mut bank = d.pool.collect();
        bank.set_charge(300);
        bank.lend(3);
    }
    d.note_denial();
    d.clear();
    assert_eq!(d.used(), 0);
    assert_eq!(d.overhead(), 0);
    assert_eq!(d.pool.charge(), 0);
    assert!(!d.pool.take(3, 1), "credit lent before the clear is void");
    assert_eq!(d.pool.collect().credit(), 0, "and so is the bank's");
    assert_eq!(d.budget(), Budget::Bytes(1000));
    assert_eq!(d.peak(), 150);
    assert_eq!(d.denials(), 1);
}

#[test]
fn a_stream_ordered_request_may_be_held_only_within_the_budget_and_below_take_max() {
    assert!(PoolCredit::may_hold(0, 0));
    assert!(PoolCredit::may_hold(100, 100));
    assert!(!PoolCredit::may_hold(101, 100));
    assert!(PoolCredit::may_hold(TAKE_MAX - 1, u64::MAX));
    assert!(!PoolCredit::may_hold(TAKE_MAX, u64::MAX));
    assert!(!PoolCredit::may_hold(u64::MAX, u64::MAX));
}

#[test]
fn each_shard_spends_and_gets_back_its_own_credit() {
    for s in 0..POOL_SHARDS {
        let other = (s + 1) % POOL_SHARDS;
        let p = PoolCredit::new();
        {
            let mut bank = p.collect();
            bank.set_charge(1000);
            bank.lend(s);
            assert_eq!(bank.credit(), 0, "all of it lent");
        }
        assert!(p.take(s, 600), "shard {s} spends what was lent to it");
        p.give(s, 600);
        assert!(p.take(s, 1000), "shard {s} got its free back");
        assert!(!p.take(other, 1), "shard {other} has none of it");
        assert_eq!(p.collect().credit(), 0, "and owes nothing for trying");
    }
}

#[test]
fn a_refund_puts_the_bytes_back_into_the_bank() {
    let p = PoolCredit::new();
    assert!(!p.take(0, 100));
    {
        let mut bank = p.collect();
        bank.debit(100);
        assert_eq!(bank.credit(), -100);
        // The driver refused the allocation: its debt is paid back.
        bank.refund(100);
        assert_eq!(bank.credit(), 0);
    }
    assert_eq!(p.collect().credit(), 0);
}

/// 1000 addresses as allocators hand them out: 2 MiB segments, 512-byte blocks in
/// them, and a few large strides.
fn spread_keys() -> Vec<u64> {
    let segments = (0..400u64).map(|i| 0x7f3a_0000_0000 + (i << 21));
    let blocks = (0..400u64).map(|i| 0x7f40_0020_0000 + (i << 9));
    let large = (0..200u64).map(|i| 0x7e00_0000_0000 + i * 0x1234_5000);
    segments.chain(blocks).chain(large).collect()
}

#[test]
fn addresses_spread_over_the_table_and_never_need_the_overflow() {
    let t: AddrTable<4096> = AddrTable::new();
    let keys = spread_keys();
    for (i, &k) in keys.iter().enumerate() {
        t.insert(
            k,
            Entry {
                bytes: i as u64,
                device: 2,
                kind: Kind::Direct,
            },
        );
    }
    assert_eq!(
        t.overflow_len.load(Ordering::Relaxed),
        0,
        "every address found a slot in its window"
    );
    for (i, &k) in keys.iter().enumerate() {
        assert_eq!(t.remove(k).map(|e| e.bytes), Some(i as u64));
    }
}

#[test]
fn addresses_zero_and_all_ones_are_never_recorded_and_take_no_slot() {
    let t: AddrTable<WINDOW> = AddrTable::new();
    let e = |bytes| Entry {
        bytes,
        device: 0,
        kind: Kind::Direct,
    };
    t.insert(EMPTY, e(1));
    t.insert(BUSY, e(2));
    assert_eq!(t.remove(EMPTY), None);
    assert_eq!(t.remove(BUSY), None);
    // Every slot is still free: a table's worth of addresses fits in the slots.
    for k in 1..=WINDOW as u64 {
        t.insert(k << 21, e(k));
    }
    assert_eq!(t.overflow_len.load(Ordering::Relaxed), 0);
    for k in 1..=WINDOW as u64 {
        assert_eq!(t.remove(k << 21), Some(e(k)));
    }
}

#[test]
fn a_purge_leaves_a_slot_being_filled_to_its_inserter() {
    let t: AddrTable<WINDOW> = AddrTable::new();
    let e = |bytes, device| Entry {
        bytes,
        device,
        kind: Kind::Direct,
    };
    // Another device's blocks fill every slot but one.
    for k in 1..WINDOW as u64 {
        t.insert(k << 21, e(k, 1));
    }
    // A thread has claimed the last slot for a block of device 0 and written its
    // value, but not yet its key.
    let slot = t
        .slots
        .iter()
        .find(|s| s.key.load(Ordering::Relaxed) == EMPTY)
        .unwrap();
    slot.key.store(BUSY, Ordering::Relaxed);
    slot.value.store(e(7, 0).pack(), Ordering::Relaxed);
    t.purge_device(0);
    // Meanwhile nobody else may take that slot.
    t.insert(0x40 << 21, e(99, 1));
    assert_eq!(
        t.overflow_len.load(Ordering::Relaxed),
        1,
        "the slot being filled was not given away"
    );
    // The inserter publishes its key: its block is found.
    slot.key.store(0x41 << 21, Ordering::Release);
    assert_eq!(t.remove(0x41 << 21), Some(e(7, 0)));
    assert_eq!(t.remove(0x40 << 21), Some(e(99, 1)));
    for k in 1..WINDOW as u64 {
        assert_eq!(t.remove(k << 21), Some(e(k, 1)));
    }
}

#[test]
fn purging_a_device_drops_its_entries_in_the_overflow_too() {
    let t: AddrTable<WINDOW> = AddrTable::new();
    let keys: Vec<u64> = (1..=3 * WINDOW as u64).map(|k| k << 21).collect();
    let e = |k: u64, i: usize| Entry {
        bytes: k,
        device: i % 2,
        kind: Kind::Direct,
    };
    for (i, &k) in keys.iter().enumerate() {
        t.insert(k, e(k, i));
    }
    assert!(t.overflow_len.load(Ordering::Relaxed) > 0);
    t.purge_device(0);
    for (i, &k) in keys.iter().enumerate() {
        let want = (i % 2 == 1).then_some(e(k, i));
        assert_eq!(t.remove(k), want, "{k:#x}");
    }
    assert_eq!(t.overflow_len.load(Ordering::Relaxed), 0);
}

/// Puts the lanes back as they were, even when the test fails.
struct LanesAsBefore(u32);

impl Drop for LanesAsBefore {
    fn drop(&mut self) {
        LANES_TAKEN.store(self.0, Ordering::Release);
    }
}

#[test]
fn after_a_fork_every_lane_but_the_forking_threads_is_free() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let _restore = LanesAsBefore(LANES_TAKEN.load(Ordering::Acquire));
    let held: Vec<usize> = (0..3).map(|_| claim_lane()).collect();
    let own = held[1];
    // The child has only the forking thread: the others' lanes are free again.
    lanes_after_fork(own);
    assert!(lane_free());
    let given: Vec<usize> = std::iter::from_fn(|| Some(claim_lane()))
        .take_while(|&lane| lane != 0)
        .collect();
    let expected: Vec<usize> = (1..LANES).filter(|&lane| lane != own).collect();
    assert_eq!(given, expected, "lowest first, never the forking thread's");
    assert!(!lane_free(), "every lane is taken");
    release_lane(given[0]);
    assert!(lane_free());
    assert_eq!(claim_lane(), given[0]);
    // A thread without a lane forks: every lane is free in the child.
    for own in [0, LANES] {
        lanes_after_fork(own);
        assert_eq!(claim_lane(), 1);
        assert_eq!(claim_lane(), 2);
    }
}

#[test]
fn a_threads_lane_holds_a_thousand_spread_blocks() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    static T: LaneTable<4096> = LaneTable::new();
    let lane = claim_lane();
    let keys = spread_keys();
    for (i, &k) in keys.iter().enumerate() {
        assert!(T.insert(k, pooled(i as u64), lane), "no room for {k:#x}");
    }
    for (i, &k) in keys.iter().enumerate() {
        assert_eq!(T.remove(k, lane, record_open), Some(pooled(i as u64)));
    }
    release_lane(lane);
}

#[test]
fn lanes_never_record_or_find_addresses_zero_and_all_ones() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    static T: LaneTable<64> = LaneTable::new();
    static M: PointerMap = PointerMap::new();
    let lane = claim_lane();
    for key in [EMPTY, BUSY] {
        assert!(!T.insert(key, pooled(1), lane));
        assert_eq!(T.remove(key, lane, record_open), None);
        assert_eq!(T.remove(key, 0, record_open), None);
        let region = M.own_region(lane).unwrap();
        assert!(!region.insert(key, pooled(1)));
        assert_eq!(region.take(key), None);
        assert_eq!(M.remove_pooled(key, lane, record_open), None);
        assert_eq!(Table::remove(&M, key, record_open), None);
    }
    release_lane(lane);
}

#[test]
fn a_block_recorded_in_its_threads_lane_is_found_there() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    static M: PointerMap = PointerMap::new();
    let lane = claim_lane();
    let other = claim_lane();
    let key = 0x7f00_0000_0000;
    let (own, others) = (M.own_region(lane).unwrap(), M.own_region(other).unwrap());
    assert!(own.insert(key, pooled(5)));
    assert_eq!(others.take(key), None, "not in another lane");
    assert_eq!(own.take(key), Some(pooled(5).packed()));
    assert_eq!(own.take(key), None);
    assert!(M.own_region(0).is_none(), "lane 0 is no lane");
    assert!(M.own_region(LANES).is_none(), "nor one past the table");
    // A block left in the lane by its thread is found by another's.
    assert!(own.insert(key, pooled(6)));
    assert_eq!(M.remove_pooled(key, other, record_open), Some(pooled(6)));
    release_lane(lane);
    release_lane(other);
}

#[test]
fn purging_a_device_drops_its_blocks_from_the_lanes_and_the_shared_table() {
    let _turn = LANE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    static M: PointerMap = PointerMap::new();
    let lane = claim_lane();
    let e = |device| Entry {
        bytes: 64,
        device,
        kind: Kind::Pooled,
    };
    let device_of = |k: u64| 4 + (k % 2) as usize;
    let shared = |k: u64| (k << 21) | 0x1000_0000_0000;
    for k in 1..=40u64 {
        M.insert_in_lane(k << 21, e(device_of(k)), lane);
        Table::insert(&M, shared(k), e(device_of(k)));
    }
    M.purge_device(4);
    for k in 1..=40u64 {
        let want = (device_of(k) == 5).then_some(e(5));
        assert_eq!(
            M.remove_pooled(k << 21, lane, record_open),
            want,
            "lane, {k}"
        );
        assert_eq!(
            Table::remove(&M, shared(k), record_open),
            want,
            "shared, {k}"
        );
    }
    release_lane(lane);
}

/// Credit is spent on the fast path by comparing its epoch with the device's alone: no
/// two devices' epochs are ever equal, however often each retires credit or is cleared.
#[test]
fn no_two_devices_ever_share_an_epoch() {
    let ledger = Ledger::new();
    let seen = |ledger: &Ledger| {
        let epochs: std::collections::BTreeSet<u64> =
            ledger.devices().map(|(_, d)| d.epoch()).collect();
        assert_eq!(epochs.len(), MAX_DEVICES);
        for (device, d) in ledger.devices() {
            assert_eq!(d.epoch() % 64, device as u64, "the epoch names its device");
        }
    };
    seen(&ledger);
    for (device, d) in ledger.devices() {
        for _ in 0..device {
            d.retire_credit();
        }
        if device % 3 == 0 {
            d.clear();
        }
    }
    seen(&ledger);
    // Retirements wrap within their bits, never into the device's or the books'.
    let d = ledger.device(5).unwrap();
    d.epoch.store((3 << 32) | 0xffff_ffc5, Ordering::Relaxed);
    d.retire_credit();
    assert_eq!(d.epoch(), (3 << 32) | 5);
    seen(&ledger);
}

#[test]
fn retiring_credit_never_carries_into_the_books_epoch() {
    let d = device(100);
    d.epoch.store((7 << 32) | 0xffff_ffff, Ordering::Relaxed);
    let before = d.epoch();
    d.retire_credit();
    assert_eq!(d.books_epoch(), 7);
    assert!(d.same_books(before));
    assert_ne!(d.epoch(), before, "the credit given before is retired");
}

#[test]
fn a_packed_entry_gives_its_bytes_to_its_own_devices_tag_only() {
    const MAX: u64 = 8 << 20;
    assert_eq!(direct_tag(64), NO_TAG);
    assert_eq!(pooled_tag(64), NO_TAG, "no entry names device 64");
    assert_eq!(pooled_tag(usize::MAX), NO_TAG);
    for device in [0usize, 1, 5, 63] {
        let tag = pooled_tag(device);
        for bytes in [0, 7, MAX] {
            let entry = Entry {
                device,
                ..pooled(bytes)
            };
            let packed = entry.packed();
            assert_eq!(packed.bytes_if(tag, MAX), Some(bytes), "device {device}");
            assert_eq!(packed.bytes(), bytes);
            assert_eq!(packed.entry(), entry);
            for other in [device ^ 1, device ^ 32, device + 64, usize::MAX] {
                let other_tag = pooled_tag(other);
                assert_eq!(packed.bytes_if(other_tag, MAX), None, "{device} as {other}");
            }
            let direct = Entry {
                kind: Kind::Direct,
                ..entry
            };
            assert_eq!(direct.packed().bytes_if(tag, MAX), None, "direct");
            // The synchronous fast free matches a direct entry by its own tag.
            assert_eq!(
                direct.packed().bytes_if(direct_tag(device), MAX),
                Some(bytes),
                "direct on {device}"
            );
            assert_eq!(packed.bytes_if(direct_tag(device), MAX), None, "pooled");
            assert_eq!(
                direct.packed().bytes_if(direct_tag(device ^ 1), MAX),
                None,
                "direct on {device} as {}",
                device ^ 1
            );
        }
        // More than `max`: none, on the right device too.
        let big = Entry {
            device,
            ..pooled(MAX + 1)
        };
        assert_eq!(big.packed().bytes_if(tag, MAX), None);
        // The largest entry of the device just below: its top byte is one less, and
        // what is left wraps past 2^56.
        if device > 0 {
            let below = Entry {
                device: device - 1,
                ..pooled(SIZE_MASK)
            };
            assert_eq!(below.packed().bytes_if(tag, MAX), None);
        }
    }
}
