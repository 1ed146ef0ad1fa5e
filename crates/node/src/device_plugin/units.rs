//! The units of `cudabudget.io/memory`: each GPU's memory less the reserve, cut into
//! units of one size, each unit a device of the kubelet's tied to its GPU. This file is
//! pure (no NVML, no gRPC): what is advertised, which units a container should get and
//! whether a set of units is one budget.

use std::collections::BTreeMap;

use crate::nvml::Gpu;

/// A GPU's units: `<uuid>-<k>` for k in 0..count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuUnits {
    pub index: u32,
    pub uuid: String,
    pub count: u64,
}

/// Every GPU's units, and the size of one.
#[derive(Clone, Debug)]
pub struct Layout {
    pub unit: u64,
    pub gpus: Vec<GpuUnits>,
}

/// A container's units as one budget: the GPU they are on and how many.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub uuid: String,
    pub units: u64,
    pub bytes: u64,
}

/// The kubelet's device ID of unit `k` of the GPU `uuid` (at most 63 characters: a
/// UUID is 40).
pub fn device_id(uuid: &str, k: u64) -> String {
    format!("{uuid}-{k}")
}

impl Layout {
    /// Units of `unit` bytes on each GPU: floor((memory − reserve) / unit), none on a GPU
    /// smaller than the reserve.
    pub fn new(gpus: &[Gpu], unit: u64, reserve: u64) -> Layout {
        assert!(unit > 0, "a unit has at least one byte");
        Layout {
            unit,
            gpus: gpus
                .iter()
                .map(|gpu| GpuUnits {
                    index: gpu.index,
                    uuid: gpu.uuid.clone(),
                    count: gpu.total.saturating_sub(reserve) / unit,
                })
                .collect(),
        }
    }

    /// Every unit's ID with the index of its GPU, GPU by GPU.
    pub fn ids(&self) -> impl Iterator<Item = (u32, String)> + '_ {
        self.gpus
            .iter()
            .flat_map(|gpu| (0..gpu.count).map(move |k| (gpu.index, device_id(&gpu.uuid, k))))
    }

    /// The GPU a unit's ID names, with the unit's number, or None for an ID that is not
    /// one of ours.
    fn locate(&self, id: &str) -> Option<(&GpuUnits, u64)> {
        let (uuid, k) = id.rsplit_once('-')?;
        let k: u64 = k.parse().ok()?;
        if k.to_string() != id.rsplit_once('-')?.1 {
            return None;
        }
        let gpu = self.gpus.iter().find(|gpu| gpu.uuid == uuid)?;
        (k < gpu.count).then_some((gpu, k))
    }

    /// The units the plugin would rather give a container of `size` units: all on one
    /// GPU, the one with the fewest available units that still has enough (so the GPUs
    /// with the most room stay whole for larger containers), the `must` ones first.
    /// Empty when no one GPU can hold them: the kubelet then chooses, and `grant`
    /// refuses what it chose.
    pub fn prefer(&self, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let mut by_gpu: BTreeMap<&str, Vec<(u64, &String)>> = BTreeMap::new();
        for id in available.iter().chain(must) {
            if let Some((gpu, k)) = self.locate(id) {
                let units = by_gpu.entry(gpu.uuid.as_str()).or_default();
                if !units.iter().any(|(_, known)| *known == id) {
                    units.push((k, id));
                }
            }
        }
        let must_gpus: Vec<&str> = must
            .iter()
            .filter_map(|id| self.locate(id).map(|(gpu, _)| gpu.uuid.as_str()))
            .collect();
        let Some((_, units)) = by_gpu
            .iter_mut()
            .filter(|(uuid, units)| {
                units.len() >= size && must_gpus.iter().all(|must_gpu| must_gpu == *uuid)
            })
            .min_by_key(|(_, units)| units.len())
        else {
            return Vec::new();
        };
        // The must ones first, then the lowest numbers.
        units.sort_by_key(|(k, id)| (!must.contains(id), *k));
        units
            .iter()
            .take(size)
            .map(|(_, id)| (*id).clone())
            .collect()
    }

    /// The budget of a container given `ids`, or why they are not one: an ID that is not
    /// one of ours, or units on more than one GPU.
    pub fn grant(&self, ids: &[String]) -> Result<Grant, String> {
        if ids.is_empty() {
            return Err("no units were given".to_string());
        }
        let mut per_gpu: BTreeMap<&str, u64> = BTreeMap::new();
        for id in ids {
            let Some((gpu, _)) = self.locate(id) else {
                return Err(format!(
                    "{id:?} is not a unit of this node's GPUs \
                     (the GPUs changed since the kubelet was told? the plugin re-sends its list)"
                ));
            };
            *per_gpu.entry(gpu.uuid.as_str()).or_default() += 1;
        }
        if per_gpu.len() > 1 {
            let spread: Vec<String> = per_gpu
                .iter()
                .map(|(uuid, units)| format!("{units} on {uuid}"))
                .collect();
            let most = self.gpus.iter().map(|gpu| gpu.count).max().unwrap_or(0);
            return Err(format!(
                "the {} units given to this container are on {} GPUs \
                 ({}): a container's budget must be on one GPU, and no GPU of this node has \
                 that many free; ask for at most what one GPU has free (each GPU here has \
                 {most} units of {} in all)",
                ids.len(),
                per_gpu.len(),
                spread.join(", "),
                human(self.unit)
            ));
        }
        let (uuid, units) = per_gpu.into_iter().next().expect("one GPU");
        Ok(Grant {
            uuid: uuid.to_string(),
            units,
            bytes: units.saturating_mul(self.unit),
        })
    }
}

/// A byte count as a quantity: `1Gi`, `512Mi`, or bytes.
pub fn human(bytes: u64) -> String {
    for (suffix, size) in [
        ("Ti", 1u64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{suffix}", bytes / size);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn two_gpus() -> Layout {
        let gpus = [
            Gpu {
                index: 0,
                uuid: "GPU-a".into(),
                total: 80 * GI,
            },
            Gpu {
                index: 1,
                uuid: "GPU-b".into(),
                total: 80 * GI + GI / 2,
            },
        ];
        Layout::new(&gpus, GI, 2 * GI)
    }

    fn ids(uuid: &str, range: std::ops::Range<u64>) -> Vec<String> {
        range.map(|k| device_id(uuid, k)).collect()
    }

    #[test]
    fn each_gpu_has_its_memory_less_the_reserve_in_whole_units() {
        let layout = two_gpus();
        assert_eq!(layout.gpus[0].count, 78);
        assert_eq!(layout.gpus[1].count, 78);
        assert_eq!(layout.ids().count(), 156);
        let small = Layout::new(
            &[Gpu {
                index: 0,
                uuid: "GPU-c".into(),
                total: GI,
            }],
            GI,
            2 * GI,
        );
        assert_eq!(
            small.gpus[0].count, 0,
            "a GPU smaller than the reserve has no unit"
        );
    }

    #[test]
    fn a_container_is_preferred_on_the_fullest_gpu_that_still_fits() {
        let layout = two_gpus();
        let mut available = ids("GPU-a", 0..78);
        available.extend(ids("GPU-b", 50..78));
        assert_eq!(layout.prefer(&available, &[], 20), ids("GPU-b", 50..70));
        assert_eq!(layout.prefer(&available, &[], 30), ids("GPU-a", 0..30));
        assert!(layout.prefer(&available, &[], 79).is_empty());
        let must = vec![device_id("GPU-a", 77)];
        let preferred = layout.prefer(&available, &must, 3);
        assert_eq!(
            preferred,
            vec![
                device_id("GPU-a", 77),
                device_id("GPU-a", 0),
                device_id("GPU-a", 1)
            ]
        );
    }

    #[test]
    fn units_on_one_gpu_are_one_budget_and_units_on_two_are_refused() {
        let layout = two_gpus();
        let grant = layout.grant(&ids("GPU-b", 0..20)).unwrap();
        assert_eq!(
            grant,
            Grant {
                uuid: "GPU-b".into(),
                units: 20,
                bytes: 20 * GI
            }
        );
        let mut spread = ids("GPU-a", 0..60);
        spread.extend(ids("GPU-b", 0..19));
        let error = layout.grant(&spread).unwrap_err();
        assert!(error.contains("the 79 units given"), "{error}");
        assert!(
            error.contains("on 2 GPUs (60 on GPU-a, 19 on GPU-b)"),
            "{error}"
        );
        for unknown in ["GPU-c-0", "GPU-a-78", "GPU-a-01", "GPU-a", "x"] {
            let error = layout.grant(&[unknown.to_string()]).unwrap_err();
            assert!(
                error.contains("is not a unit of this node's GPUs"),
                "{error}"
            );
        }
    }
}
