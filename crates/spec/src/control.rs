//! A request to change a running process's budget (`cudabudget limit --pid`), written by
//! the command line beside the process's record, as `<pid>-<pid namespace>.limit` in the
//! same private directory (only its owner and root can write there), and read by the
//! process's background thread when the directory's [`crate::doorbell`] rings (at once),
//! or at its next look (every 200 ms). Each request is a new file renamed over the
//! last, so a new inode is a new request. A job's budget lives in its ledger instead
//! ([`crate::job_file::BUDGETS_AT`]).
//!
//! ```text
//! cudabudget-limit 1
//! device all
//! bytes 21474836480
//! by 1000 4242
//! ```

const FIRST_LINE: &str = "cudabudget-limit 1";

/// A change of a process's budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitRequest {
    /// One device (the process's ordinal), or every budgeted device.
    pub device: Option<u32>,
    pub bytes: u64,
    /// Who asked: uid and pid.
    pub by_uid: u32,
    pub by_pid: u32,
}

/// The request's file name for the record `<pid>-<namespace>.rec`.
pub fn file_name(pid: u32, namespace: u64) -> String {
    format!("{pid}-{namespace}.limit")
}

impl LimitRequest {
    pub fn encode(&self) -> String {
        let device = self
            .device
            .map_or_else(|| "all".to_string(), |d| d.to_string());
        format!(
            "{FIRST_LINE}\ndevice {device}\nbytes {}\nby {} {}\n",
            self.bytes, self.by_uid, self.by_pid
        )
    }

    /// The request in `text`, or why it is not one (nothing partial is accepted).
    pub fn parse(text: &str) -> Result<LimitRequest, String> {
        let mut lines = text.lines();
        if lines.next() != Some(FIRST_LINE) {
            return Err(format!("it does not start with {FIRST_LINE:?}"));
        }
        let mut field = |name: &str| -> Result<Vec<&str>, String> {
            let line = lines.next().ok_or_else(|| format!("no {name} line"))?;
            let mut words = line.split(' ');
            if words.next() != Some(name) {
                return Err(format!("{line:?} is not the {name} line"));
            }
            Ok(words.collect())
        };
        let number = |s: &str| -> Result<u64, String> {
            if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{s:?} is not a number"));
            }
            s.parse().map_err(|_| format!("{s:?} is out of range"))
        };
        let device = match field("device")?.as_slice() {
            ["all"] => None,
            [n] => Some(
                u32::try_from(number(n)?)
                    .ok()
                    .filter(|&d| (d as usize) < crate::record::MAX_DEVICES)
                    .ok_or_else(|| format!("device {n} is out of range"))?,
            ),
            _ => return Err("the device line has one word".to_string()),
        };
        let bytes = match field("bytes")?.as_slice() {
            [n] => number(n)?,
            _ => return Err("the bytes line has one word".to_string()),
        };
        let (by_uid, by_pid) = match field("by")?.as_slice() {
            [uid, pid] => (
                u32::try_from(number(uid)?).map_err(|_| "uid out of range".to_string())?,
                u32::try_from(number(pid)?).map_err(|_| "pid out of range".to_string())?,
            ),
            _ => return Err("the by line has two words".to_string()),
        };
        Ok(LimitRequest {
            device,
            bytes,
            by_uid,
            by_pid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reads_back_as_it_was_written() {
        for device in [None, Some(0), Some(7)] {
            let r = LimitRequest {
                device,
                bytes: 20 << 30,
                by_uid: 1000,
                by_pid: 4242,
            };
            assert_eq!(LimitRequest::parse(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn anything_but_a_whole_request_is_refused() {
        let good = "cudabudget-limit 1\ndevice 0\nbytes 10\nby 0 1\n";
        assert!(LimitRequest::parse(good).is_ok());
        for bad in [
            "",
            "cudabudget-limit 2\ndevice 0\nbytes 10\nby 0 1\n",
            "cudabudget-limit 1\ndevice 0\nbytes 10\n",
            "cudabudget-limit 1\ndevice 64\nbytes 10\nby 0 1\n",
            "cudabudget-limit 1\ndevice 0\nbytes -1\nby 0 1\n",
            "cudabudget-limit 1\ndevice 0\nbytes 99999999999999999999\nby 0 1\n",
            "cudabudget-limit 1\ndevice 0 1\nbytes 10\nby 0 1\n",
            "cudabudget-limit 1\nbytes 10\ndevice 0\nby 0 1\n",
        ] {
            assert!(LimitRequest::parse(bad).is_err(), "{bad:?}");
        }
    }
}
