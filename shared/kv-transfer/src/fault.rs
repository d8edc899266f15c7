//! Fault injection for the transfer agent.
//!
//! Every failure the KV lifecycle must survive (LIFECYCLE.md, R3/R4) can be switched on from
//! configuration, and the agent then takes the *real* failure path at the matching point: P's
//! side channel really answers garbage or nothing, D really stops a copy half way. Tests and
//! load tests therefore exercise production code, not mocks. Each fault acts on one side; the
//! other side's config ignores it. See `docs/KV_TRANSFER.md` for the table.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

/// Which failures to inject. Parsed from a comma list, e.g.
/// `"compat_mismatch,drop_read_done,delay_transfer_ms=200"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultConfig {
    /// P: the side channel does not answer metadata requests (D's handshake times out).
    pub handshake_timeout: bool,
    /// P: advertise a different compatibility hash (D refuses: `CompatMismatch`).
    pub compat_mismatch: bool,
    /// P: answer metadata requests with a truncated frame (D: `UndecodableMetadata`).
    pub undecodable_metadata: bool,
    /// P: advertise a different engine id (D: `EngineIdMismatch`).
    pub engine_id_mismatch: bool,
    /// P: refuse every lease (`LeaseRefusalReason::FaultInjected`).
    pub lease_refused: bool,
    /// D: a block read fails before any byte is copied (local blocks untouched).
    pub transfer_setup_error: bool,
    /// D: a block read fails after about half of its bytes were copied (local blocks
    /// partially written; over TCP the connection is really dropped mid-stream).
    pub transfer_midway: bool,
    /// D: the task running a read dies without a result (aborted before it reports), the
    /// analogue of an exception escaping a transfer backend; the worker's failure handler must
    /// still settle the request and give the lease back.
    pub transfer_exception: bool,
    /// D: `read done` is not sent (as if lost); P frees on lease expiry instead.
    pub drop_read_done: bool,
    /// D: every block read waits this long before copying.
    pub delay_transfer: Option<Duration>,
}

/// A fault list that could not be parsed. Unknown names are errors, so a typo never silently
/// disables a test's fault.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FaultParseError {
    #[error("unknown fault {0:?} (known: {KNOWN})")]
    Unknown(String),
    #[error("fault {name}: bad value {value:?}")]
    BadValue { name: String, value: String },
}

const KNOWN: &str = "handshake_timeout, compat_mismatch, undecodable_metadata, engine_id_mismatch, \
                     lease_refused, transfer_setup_error, transfer_midway, transfer_exception, drop_read_done, delay_transfer_ms=N";

impl FaultConfig {
    /// No fault.
    pub fn none() -> Self {
        Self::default()
    }

    /// Parse a comma list (whitespace and empty items ignored).
    pub fn parse(s: &str) -> Result<Self, FaultParseError> {
        let mut f = Self::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (item, None),
            };
            let flag = match name {
                "handshake_timeout" => &mut f.handshake_timeout,
                "compat_mismatch" => &mut f.compat_mismatch,
                "undecodable_metadata" => &mut f.undecodable_metadata,
                "engine_id_mismatch" => &mut f.engine_id_mismatch,
                "lease_refused" => &mut f.lease_refused,
                "transfer_setup_error" => &mut f.transfer_setup_error,
                "transfer_midway" => &mut f.transfer_midway,
                "transfer_exception" => &mut f.transfer_exception,
                "drop_read_done" => &mut f.drop_read_done,
                "delay_transfer_ms" => {
                    let bad = || FaultParseError::BadValue { name: name.into(), value: value.unwrap_or("").into() };
                    let ms: u64 = value.ok_or_else(bad)?.parse().map_err(|_| bad())?;
                    f.delay_transfer = Some(Duration::from_millis(ms));
                    continue;
                }
                other => return Err(FaultParseError::Unknown(other.to_string())),
            };
            if let Some(v) = value {
                *flag = match v {
                    "1" | "true" | "on" => true,
                    "0" | "false" | "off" => false,
                    _ => return Err(FaultParseError::BadValue { name: name.into(), value: v.into() }),
                };
            } else {
                *flag = true;
            }
        }
        Ok(f)
    }

    /// Whether any fault is on.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

impl FromStr for FaultConfig {
    type Err = FaultParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for FaultConfig {
    /// The comma list that parses back to `self`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let flags = [
            ("handshake_timeout", self.handshake_timeout),
            ("compat_mismatch", self.compat_mismatch),
            ("undecodable_metadata", self.undecodable_metadata),
            ("engine_id_mismatch", self.engine_id_mismatch),
            ("lease_refused", self.lease_refused),
            ("transfer_setup_error", self.transfer_setup_error),
            ("transfer_midway", self.transfer_midway),
            ("transfer_exception", self.transfer_exception),
            ("drop_read_done", self.drop_read_done),
        ];
        let mut items: Vec<String> = flags.iter().filter(|(_, on)| *on).map(|(n, _)| n.to_string()).collect();
        if let Some(d) = self.delay_transfer {
            items.push(format!("delay_transfer_ms={}", d.as_millis()));
        }
        f.write_str(&items.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_full_list_and_round_trips() {
        let s = "handshake_timeout,compat_mismatch,undecodable_metadata,engine_id_mismatch,lease_refused,\
                 transfer_setup_error,transfer_midway,transfer_exception,drop_read_done,delay_transfer_ms=200";
        let f = FaultConfig::parse(s).unwrap();
        assert!(f.handshake_timeout && f.compat_mismatch && f.undecodable_metadata && f.engine_id_mismatch);
        assert!(f.lease_refused && f.transfer_setup_error && f.transfer_midway && f.drop_read_done);
        assert!(f.transfer_exception);
        assert_eq!(f.delay_transfer, Some(Duration::from_millis(200)));
        assert_eq!(FaultConfig::parse(&f.to_string()).unwrap(), f);
    }

    #[test]
    fn empty_and_whitespace_mean_none() {
        assert!(FaultConfig::parse("").unwrap().is_empty());
        assert!(FaultConfig::parse(" , ,").unwrap().is_empty());
        assert!(FaultConfig::parse(" lease_refused , ").unwrap().lease_refused);
        assert!(!FaultConfig::parse("lease_refused=off").unwrap().lease_refused);
    }

    #[test]
    fn typos_and_bad_values_are_errors() {
        assert_eq!(FaultConfig::parse("lease_refsed"), Err(FaultParseError::Unknown("lease_refsed".into())));
        assert!(matches!(FaultConfig::parse("delay_transfer_ms"), Err(FaultParseError::BadValue { .. })));
        assert!(matches!(FaultConfig::parse("delay_transfer_ms=x"), Err(FaultParseError::BadValue { .. })));
        assert!(matches!(FaultConfig::parse("drop_read_done=maybe"), Err(FaultParseError::BadValue { .. })));
    }
}
