//! A size in bytes as people write it in a config file: `2147483648`, `"2GiB"`, `"512 MiB"`,
//! `"1.5GB"`. Binary units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024, decimal ones (`KB`,
//! `MB`, `GB`, `TB`) powers of 1000, `B` or no unit is bytes; case does not matter. Written back
//! as a plain integer of bytes, which reads the same.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count read from an integer or a string with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parse `"2GiB"`-style text; the error says what was wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let num: f64 =
            num.parse().map_err(|_| format!("{text:?} is not a size (write e.g. \"2GiB\" or 2147483648)"))?;
        let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            other => return Err(format!("{text:?}: unknown unit {other:?} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
        };
        let bytes = num * mult;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(format!("{text:?} is out of range"));
        }
        Ok(Self(bytes as u64))
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0 as f64;
        const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
        const MIB: f64 = 1024.0 * 1024.0;
        if b >= GIB {
            write!(f, "{:.2} GiB", b / GIB)
        } else if b >= MIB {
            write!(f, "{:.1} MiB", b / MIB)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(Self(n)),
            Raw::Text(t) => Self::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::ByteSize;

    #[test]
    fn units_parse() {
        assert_eq!(ByteSize::parse("2GiB").unwrap().0, 2 << 30);
        assert_eq!(ByteSize::parse("512 MiB").unwrap().0, 512 << 20);
        assert_eq!(ByteSize::parse("1.5GB").unwrap().0, 1_500_000_000);
        assert_eq!(ByteSize::parse("4096").unwrap().0, 4096);
        assert_eq!(ByteSize::parse("8kib").unwrap().0, 8192);
        assert!(ByteSize::parse("two gigs").is_err());
        assert!(ByteSize::parse("2 parsecs").unwrap_err().contains("unknown unit"));
        assert!(ByteSize::parse("").is_err());
    }
}
