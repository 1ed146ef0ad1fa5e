//! What is measured after the fact: memory the driver already holds when its figure
//! comes (a created pool's reserve, graph memory, a library's globals found at their
//! first look-up, the real pitch of an allocation, what survives a context's end, the
//! footprint's overhead). No
//! admission can refuse it any more: [`charge_after`] is the one place it reaches the
//! books, whoever measured it ([`super::loads`], [`super::footprint`], [`super::pools`],
//! [`super::graphs`], [`super::flow`]).

use crate::books::ledger::DeviceLedger;

/// The driver's figure `now` for something the device was charged `charged` for: the
/// difference is charged whatever the budget says when it grew (the memory is held
/// already), and given back when it shrank.
pub fn charge_after(d: &DeviceLedger, charged: u64, now: u64) {
    if now >= charged {
        d.charge(now - charged);
    } else {
        d.release(charged - now);
    }
}

/// The footprint's figure for what no hook saw on the device (its overhead: the context,
/// modules, paths we do not hook) becomes `now`, charged as [`charge_after`] against what
/// the overhead was.
pub fn overhead_after(d: &DeviceLedger, now: u64) {
    charge_after(d, d.swap_overhead(now), now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::books::ledger::Budget;

    #[test]
    fn a_figure_measured_after_the_fact_is_charged_past_the_budget_and_given_back_when_it_shrinks()
    {
        let d = crate::runtime::ledger().device(57).unwrap();
        d.set_budget(Budget::Bytes(100));
        d.reserve(90, d.in_force()).unwrap().commit();
        // The driver already holds it: nothing can refuse it now.
        charge_after(d, 0, 30);
        assert_eq!(d.used(), 120);
        charge_after(d, 30, 10);
        assert_eq!(d.used(), 100);
        charge_after(d, 10, 10);
        assert_eq!(d.used(), 100);
    }
}
