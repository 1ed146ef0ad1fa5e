//! Quantities: the text a user writes for a budget ("20Gi", "40%", HAMi's "8192m")
//! and the human form of byte counts used in messages.
//!
//! This module owns both budget grammars and nothing else: it is pure (no libc, no
//! driver, no environment) so the library and the CLI compile the same file and a
//! value means the same thing in both. Every error carries a reason a user can act
//! on, because it ends up in the one line that tells them why CUDA was refused.

use std::fmt;

/// A budget as written by the user, before the device's size is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// A fixed number of bytes.
    Bytes(u64),
    /// Hundredths of a percent of the device's physical memory, 1..=10000
    /// (40% -> 4000, 12.5% -> 1250).
    Percent(u32),
}

impl Limit {
    /// The budget in bytes for a device of `physical` bytes. Percentages round down,
    /// so a budget never exceeds the share the user asked for.
    pub fn resolve(self, physical: u64) -> u64 {
        match self {
            Limit::Bytes(bytes) => bytes,
            // u128: physical * 10000 can exceed u64 for a (hypothetical) 2 PiB device.
            Limit::Percent(hundredths) => {
                (u128::from(physical) * u128::from(hundredths) / 10_000) as u64
            }
        }
    }
}

/// Why a quantity was refused; `reason` is a short phrase meant to be embedded in a
/// longer message (no "cudabudget:" prefix, no trailing period).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantityError {
    pub reason: String,
}

impl fmt::Display for QuantityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for QuantityError {}

fn refuse<T>(reason: impl Into<String>) -> Result<T, QuantityError> {
    Err(QuantityError {
        reason: reason.into(),
    })
}

/// Unit suffixes of the Kubernetes grammar and their multipliers. The `...B` spellings
/// are accepted as the same units because people write them in both forms.
const UNITS: &[(&str, u64)] = &[
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("Pi", 1 << 50),
    ("Ei", 1 << 60),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("PiB", 1 << 50),
    ("EiB", 1 << 60),
    ("k", 1_000),
    ("M", 1_000_000),
    ("G", 1_000_000_000),
    ("T", 1_000_000_000_000),
    ("P", 1_000_000_000_000_000),
    ("E", 1_000_000_000_000_000_000),
    ("kB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("PB", 1_000_000_000_000_000),
    ("EB", 1_000_000_000_000_000_000),
];

/// More decimals than this cannot change a byte count meaningfully and would overflow
/// the exact u128 arithmetic below.
const MAX_FRACTION_DIGITS: usize = 20;

const OVERFLOW: &str = "value overflows 64 bits";
const PERCENT_RANGE: &str = "percentage must be in (0, 100]";

/// A decimal number exactly as written: `whole` digits, optional `fraction` digits.
#[derive(Clone, Copy)]
struct Decimal<'a> {
    whole: &'a str,
    fraction: &'a str,
}

impl fmt::Display for Decimal<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.fraction.is_empty() {
            f.write_str(self.whole)
        } else {
            write!(f, "{}.{}", self.whole, self.fraction)
        }
    }
}

fn trim(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_ascii_whitespace())
}

fn digits(s: &str) -> usize {
    s.bytes().take_while(u8::is_ascii_digit).count()
}

/// The value of a digit string, or None past u128 (callers report overflow).
fn whole_value(digits: &str) -> Option<u128> {
    digits.bytes().try_fold(0u128, |acc, d| {
        acc.checked_mul(10)?.checked_add(u128::from(d - b'0'))
    })
}

/// Kubernetes-quantity syntax (`CUDABUDGET_LIMIT*`, `--limit`):
///
/// - number = digits [ '.' digits ]: no sign, exponent, '_' or ','; at least one digit
///   on each side of a '.'.
/// - suffix: "" (bytes) | Ki Mi Gi Ti Pi Ei (1024^n) | k M G T P E (1000^n) |
///   KiB..EiB (= Ki..Ei) | kB..EB (= k..E).
/// - percent: number '%' with 0 < p <= 100 and at most two decimals.
/// - fractional byte counts round up ("1.5Ki" = 1536, "0.5" = 1); surrounding ASCII
///   whitespace is ignored; "0" is a valid (zero) budget; more than u64::MAX is an error.
pub fn parse_limit(s: &str) -> Result<Limit, QuantityError> {
    let s = trim(s);
    let (number, suffix) = split_number(s)?;
    if suffix == "%" {
        return parse_percent(number).map(Limit::Percent);
    }
    let multiplier = unit_multiplier(number, suffix)?;
    scale(number, multiplier).map(Limit::Bytes)
}

/// Splits `s` into its leading decimal number and the rest, refusing anything that is
/// not a plain unsigned decimal at the start.
fn split_number(s: &str) -> Result<(Decimal<'_>, &str), QuantityError> {
    match s.as_bytes().first() {
        None => return refuse("empty value"),
        Some(b'-') => return refuse("negative values are not allowed"),
        Some(b'+') => return refuse("a sign is not allowed; write the number alone"),
        Some(b'.') => return refuse("a number must start with a digit (write 0.5, not .5)"),
        Some(_) => {}
    }
    let whole_len = digits(s);
    if whole_len == 0 {
        return refuse(missing_number(s));
    }
    let (whole, rest) = s.split_at(whole_len);
    let (fraction, suffix) = match rest.strip_prefix('.') {
        Some(after) => {
            let fraction_len = digits(after);
            if fraction_len == 0 {
                return refuse("a decimal point must be followed by digits (write 1 or 1.5)");
            }
            after.split_at(fraction_len)
        }
        None => ("", rest),
    };
    Ok((Decimal { whole, fraction }, suffix))
}

fn missing_number(s: &str) -> String {
    if s == "%" || UNITS.iter().any(|(unit, _)| *unit == s) {
        format!("missing number before {s:?}")
    } else {
        format!("{s:?} is not a number")
    }
}

fn parse_percent(number: Decimal<'_>) -> Result<u32, QuantityError> {
    if number.fraction.len() > 2 {
        return refuse("a percentage takes at most two decimals (e.g. 12.5%)");
    }
    let whole = whole_value(number.whole).unwrap_or(u128::MAX);
    // Pad the fraction to hundredths: "12.5" -> 1250.
    let fraction = number
        .fraction
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(2)
        .fold(0u128, |acc, d| acc * 10 + u128::from(d - b'0'));
    match whole.checked_mul(100).and_then(|w| w.checked_add(fraction)) {
        Some(hundredths @ 1..=10_000) => Ok(hundredths as u32),
        _ => refuse(PERCENT_RANGE),
    }
}

/// The multiplier of a unit suffix, or the most helpful reason it is not one.
fn unit_multiplier(number: Decimal<'_>, suffix: &str) -> Result<u64, QuantityError> {
    if suffix.is_empty() {
        return Ok(1);
    }
    if let Some((_, multiplier)) = UNITS.iter().find(|(unit, _)| *unit == suffix) {
        return Ok(*multiplier);
    }
    let first = suffix.chars().next().unwrap_or_default();
    let second = suffix.chars().nth(1);
    let reason = match first {
        c if c.is_ascii_whitespace() => {
            "no space is allowed between the number and the unit".to_string()
        }
        '.' => "more than one decimal point".to_string(),
        ',' => {
            "commas are not allowed; use '.' for decimals and no thousands separators".to_string()
        }
        '_' => "underscores are not allowed in numbers".to_string(),
        'e' | 'E' if second.is_some_and(|c| c.is_ascii_digit() || c == '-' || c == '+') => {
            "exponents are not allowed; write the digits out (1000000000) or use a unit (1G)"
                .to_string()
        }
        'x' | 'X' if number.whole == "0" && number.fraction.is_empty() => {
            "hexadecimal is not allowed; write a decimal number".to_string()
        }
        _ => unit_mistake(number, suffix),
    };
    refuse(reason)
}

/// Explains a suffix that is not a unit, recognising the usual slips: Kubernetes'
/// milli, an uppercase K, bits for bytes, and wrong letter case.
fn unit_mistake(number: Decimal<'_>, suffix: &str) -> String {
    if suffix == "m" {
        return format!("\"m\" means milli (1/1000 of a byte); did you mean \"{number}Mi\"?");
    }
    if suffix == "K" || suffix == "KB" {
        let (binary, decimal) = if suffix == "K" {
            ("Ki", "k")
        } else {
            ("KiB", "kB")
        };
        return format!("{suffix:?} is not a unit; use {binary:?} (1024) or {decimal:?} (1000)");
    }
    // "Gb", "gb", "Gib", "kb": a lowercase b means bits, which a budget never is.
    if let Some(stem) = suffix.strip_suffix('b') {
        let stem_letter = stem.strip_suffix('i').unwrap_or(stem);
        if let [letter] = stem_letter.as_bytes()
            && b"kmgtpeKMGTPE".contains(letter)
        {
            let upper = letter.to_ascii_uppercase() as char;
            let decimal = if upper == 'K' { 'k' } else { upper };
            return format!(
                "{suffix:?} means bits; for bytes use \"{upper}i\" (1024^n) or \"{decimal}\" (1000^n)"
            );
        }
    }
    let same_but_case: Vec<String> = UNITS
        .iter()
        .filter(|(unit, _)| unit.eq_ignore_ascii_case(suffix))
        .map(|(unit, _)| format!("{unit:?}"))
        .collect();
    if !same_but_case.is_empty() {
        return format!(
            "units are case-sensitive; did you mean {}?",
            same_but_case.join(" or ")
        );
    }
    format!("unknown unit {suffix:?}")
}

/// `number * multiplier`, rounded up to a whole byte, exactly (no floating point).
fn scale(number: Decimal<'_>, multiplier: u64) -> Result<u64, QuantityError> {
    let multiplier = u128::from(multiplier);
    let Some(whole) = whole_value(number.whole).and_then(|w| w.checked_mul(multiplier)) else {
        return refuse(OVERFLOW);
    };
    let fraction_digits = number.fraction.trim_end_matches('0');
    if fraction_digits.len() > MAX_FRACTION_DIGITS {
        return refuse(format!("too many decimals (at most {MAX_FRACTION_DIGITS})"));
    }
    // Both fit in u128: at most 10^20 * 2^60 < 2^127.
    let numerator = whole_value(fraction_digits).unwrap_or(0) * multiplier;
    let denominator = 10u128.pow(fraction_digits.len() as u32);
    let fraction = numerator.div_ceil(denominator);
    whole
        .checked_add(fraction)
        .and_then(|total| u64::try_from(total).ok())
        .map_or_else(|| refuse(OVERFLOW), Ok)
}

/// HAMi-core syntax (`CUDA_DEVICE_MEMORY_LIMIT*`): digits with an optional `k`, `m` or
/// `g` suffix (case-insensitive, powers of 1024), no fraction. `Ok(None)` for a zero
/// value, which HAMi reads as "no limit". Surrounding ASCII whitespace is ignored.
pub fn parse_hami(s: &str) -> Result<Option<u64>, QuantityError> {
    let s = trim(s);
    match s.as_bytes().first() {
        None => return refuse("empty value"),
        Some(b'-') => return refuse("negative values are not allowed"),
        Some(b'+') => return refuse("a sign is not allowed; write the number alone"),
        Some(_) => {}
    }
    let len = digits(s);
    if len == 0 {
        return refuse(format!("{s:?} is not a number"));
    }
    let (number, suffix) = s.split_at(len);
    let multiplier: u128 = match suffix {
        "" => 1,
        "k" | "K" => 1 << 10,
        "m" | "M" => 1 << 20,
        "g" | "G" => 1 << 30,
        _ if suffix.starts_with('.') => {
            return refuse("fractions are not allowed here; use a smaller unit (1536m, not 1.5g)");
        }
        _ => {
            return refuse(format!(
                "unknown unit {suffix:?}; this variable takes only k, m or g (powers of 1024)"
            ));
        }
    };
    let bytes = whole_value(number)
        .and_then(|n| n.checked_mul(multiplier))
        .and_then(|n| u64::try_from(n).ok());
    match bytes {
        None => refuse(OVERFLOW),
        Some(0) => Ok(None),
        Some(bytes) => Ok(Some(bytes)),
    }
}

/// Human form used in messages: "8.00 GiB", "512.00 MiB", "1023 B" (binary units, two
/// decimals, rounded to nearest; below 1 KiB the exact byte count).
pub fn format_bytes(b: u64) -> String {
    const NAMES: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let hundredths_in = |index: usize| {
        let unit = 1u128 << (10 * (index + 1));
        (u128::from(b) * 100 + unit / 2) / unit
    };
    // The largest unit that is at most `b` (b >= 1 KiB here, so one always is).
    let mut index = (0..NAMES.len())
        .rev()
        .find(|&i| b >> (10 * (i + 1)) > 0)
        .unwrap_or(0);
    let mut hundredths = hundredths_in(index);
    // Rounding can carry into the next unit: 1023.999 KiB reads better as 1.00 MiB.
    if hundredths >= 1024 * 100 && index + 1 < NAMES.len() {
        index += 1;
        hundredths = hundredths_in(index);
    }
    format!(
        "{}.{:02} {}",
        hundredths / 100,
        hundredths % 100,
        NAMES[index]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const KI: u64 = 1 << 10;
    const MI: u64 = 1 << 20;
    const GI: u64 = 1 << 30;
    const TI: u64 = 1 << 40;
    const PI: u64 = 1 << 50;
    const EI: u64 = 1 << 60;

    #[test]
    fn valid_quantities_parse_to_the_exact_budget() {
        let table: &[(&str, Limit)] = &[
            ("0", Limit::Bytes(0)),
            ("0Gi", Limit::Bytes(0)),
            ("1", Limit::Bytes(1)),
            ("1048576", Limit::Bytes(MI)),
            ("18446744073709551615", Limit::Bytes(u64::MAX)),
            ("1Ki", Limit::Bytes(KI)),
            ("512Mi", Limit::Bytes(512 * MI)),
            ("20Gi", Limit::Bytes(20 * GI)),
            ("2Ti", Limit::Bytes(2 * TI)),
            ("3Pi", Limit::Bytes(3 * PI)),
            ("15Ei", Limit::Bytes(15 * EI)),
            ("1KiB", Limit::Bytes(KI)),
            ("1MiB", Limit::Bytes(MI)),
            ("8GiB", Limit::Bytes(8 * GI)),
            ("1TiB", Limit::Bytes(TI)),
            ("1PiB", Limit::Bytes(PI)),
            ("1EiB", Limit::Bytes(EI)),
            ("5k", Limit::Bytes(5_000)),
            ("5M", Limit::Bytes(5_000_000)),
            ("8G", Limit::Bytes(8_000_000_000)),
            ("1T", Limit::Bytes(1_000_000_000_000)),
            ("1P", Limit::Bytes(1_000_000_000_000_000)),
            ("18E", Limit::Bytes(18_000_000_000_000_000_000)),
            ("5kB", Limit::Bytes(5_000)),
            ("5MB", Limit::Bytes(5_000_000)),
            ("8GB", Limit::Bytes(8_000_000_000)),
            ("1TB", Limit::Bytes(1_000_000_000_000)),
            ("1PB", Limit::Bytes(1_000_000_000_000_000)),
            ("1EB", Limit::Bytes(1_000_000_000_000_000_000)),
            ("1.5Ki", Limit::Bytes(1536)),
            ("0.5", Limit::Bytes(1)),
            ("1.0001", Limit::Bytes(2)),
            ("0.5Gi", Limit::Bytes(GI / 2)),
            ("1.5G", Limit::Bytes(1_500_000_000)),
            ("0.1Ki", Limit::Bytes(103)),
            ("2.000", Limit::Bytes(2)),
            ("007Mi", Limit::Bytes(7 * MI)),
            ("40%", Limit::Percent(4000)),
            ("12.5%", Limit::Percent(1250)),
            ("12.34%", Limit::Percent(1234)),
            ("0.01%", Limit::Percent(1)),
            ("100%", Limit::Percent(10_000)),
            ("100.00%", Limit::Percent(10_000)),
            ("  20Gi", Limit::Bytes(20 * GI)),
            ("20Gi\n", Limit::Bytes(20 * GI)),
            ("\t 40% \r\n", Limit::Percent(4000)),
        ];
        for (text, expected) in table {
            assert_eq!(parse_limit(text), Ok(*expected), "{text:?}");
        }
    }

    #[test]
    fn malformed_quantities_are_refused_with_a_reason() {
        // (value, a fragment the reason must contain)
        let table: &[(&str, &str)] = &[
            ("", "empty"),
            (" ", "empty"),
            ("\t\n", "empty"),
            ("10XB", "unknown unit \"XB\""),
            ("-1G", "negative"),
            ("-5%", "negative"),
            ("+1G", "sign"),
            ("150%", "(0, 100]"),
            ("0%", "(0, 100]"),
            ("0.00%", "(0, 100]"),
            ("100.01%", "(0, 100]"),
            ("99999999999999999999999999999999999999999%", "(0, 100]"),
            ("100.001%", "two decimals"),
            ("1.2.3Gi", "decimal point"),
            ("Gi", "missing number"),
            ("%", "missing number"),
            ("12Gig", "unknown unit \"Gig\""),
            ("1Ki1", "unknown unit \"Ki1\""),
            ("1e9", "exponent"),
            ("1E+9", "exponent"),
            ("0x10", "hexadecimal"),
            ("ten", "\"ten\" is not a number"),
            ("inf", "not a number"),
            ("NaN", "not a number"),
            ("18446744073709551616", "overflows"),
            ("17179869184Ti", "overflows"),
            ("16Ei", "overflows"),
            ("18446744073709551615.5", "overflows"),
            ("999999999999999999999999999999999999999999", "overflows"),
            ("1,5Gi", "comma"),
            ("1_000", "underscore"),
            ("5 Gi", "space"),
            ("1 %", "space"),
            ("100m", "did you mean \"100Mi\""),
            ("1.5m", "did you mean \"1.5Mi\""),
            ("1K", "\"Ki\" (1024) or \"k\" (1000)"),
            ("1KB", "\"KiB\" (1024) or \"kB\" (1000)"),
            ("8Gb", "use \"Gi\" (1024^n) or \"G\" (1000^n)"),
            ("8kb", "use \"Ki\" (1024^n) or \"k\" (1000^n)"),
            ("8Gib", "bits"),
            ("8gi", "case-sensitive; did you mean \"Gi\""),
            ("8GIB", "did you mean \"GiB\""),
            ("8g", "did you mean \"G\""),
            ("1.", "followed by digits"),
            (".5Gi", "start with a digit"),
            ("1.0000000000000000000000001Gi", "too many decimals"),
            ("Gi8", "not a number"),
        ];
        for (text, fragment) in table {
            match parse_limit(text) {
                Ok(limit) => panic!("{text:?} was accepted as {limit:?}"),
                Err(e) => assert!(
                    e.reason.contains(fragment),
                    "{text:?}: reason {:?} lacks {fragment:?}",
                    e.reason
                ),
            }
        }
    }

    #[test]
    fn every_required_malformed_value_is_refused() {
        let required = [
            "",
            " ",
            "10XB",
            "-1G",
            "150%",
            "0%",
            "100.001%",
            "1.2.3Gi",
            "Gi",
            "12Gig",
            "1e9",
            "0x10",
            "ten",
            "18446744073709551616",
            "17179869184Ti",
            "1,5Gi",
            "5 Gi",
            "100m",
            "1K",
            "8Gb",
            "+1G",
            "1.",
            ".5Gi",
            "%",
            "-5%",
            "inf",
            "NaN",
            "1_000",
            "1Ki1",
            "1 %",
        ];
        for text in required {
            let e = parse_limit(text).expect_err(text);
            assert!(!e.reason.is_empty() && !e.reason.contains('\n'), "{text:?}");
        }
    }

    #[test]
    fn percent_resolves_against_the_device_size_rounding_down() {
        assert_eq!(Limit::Percent(4000).resolve(80 * GI), 32 * GI);
        assert_eq!(Limit::Percent(1250).resolve(1000), 125);
        assert_eq!(Limit::Percent(1).resolve(9999), 0);
        assert_eq!(Limit::Percent(10_000).resolve(u64::MAX), u64::MAX);
        assert_eq!(
            Limit::Percent(3333).resolve(u64::MAX),
            6_148_299_799_767_393_553
        );
        assert_eq!(Limit::Bytes(5).resolve(1), 5);
    }

    #[test]
    fn hami_values_use_powers_of_1024_and_zero_means_unlimited() {
        let table: &[(&str, Option<u64>)] = &[
            ("0", None),
            ("0m", None),
            ("000", None),
            ("1", Some(1)),
            ("1024", Some(KI)),
            ("8k", Some(8 * KI)),
            ("8K", Some(8 * KI)),
            ("8192m", Some(8 * GI)),
            ("8192M", Some(8 * GI)),
            ("8g", Some(8 * GI)),
            ("8G", Some(8 * GI)),
            (" 8g\n", Some(8 * GI)),
            ("18446744073709551615", Some(u64::MAX)),
        ];
        for (text, expected) in table {
            assert_eq!(parse_hami(text), Ok(*expected), "{text:?}");
        }
    }

    #[test]
    fn malformed_hami_values_are_refused_with_a_reason() {
        let table: &[(&str, &str)] = &[
            ("", "empty"),
            ("  ", "empty"),
            ("-1", "negative"),
            ("+8g", "sign"),
            ("1.5g", "fractions"),
            ("8Gi", "unknown unit \"Gi\""),
            ("8GB", "unknown unit"),
            ("8t", "unknown unit"),
            ("8 g", "unknown unit"),
            ("g", "not a number"),
            ("ten", "not a number"),
            ("18446744073709551616", "overflows"),
            ("17179869184g", "overflows"),
            ("40%", "unknown unit"),
        ];
        for (text, fragment) in table {
            let e = parse_hami(text).expect_err(text);
            assert!(e.reason.contains(fragment), "{text:?}: {:?}", e.reason);
        }
    }

    #[test]
    fn byte_counts_read_in_binary_units() {
        let table: &[(u64, &str)] = &[
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1.00 KiB"),
            (1536, "1.50 KiB"),
            (512 * MI, "512.00 MiB"),
            (8 * GI, "8.00 GiB"),
            (MI - 1, "1.00 MiB"),
            (GI + GI / 4, "1.25 GiB"),
            (3 * TI, "3.00 TiB"),
            (PI, "1.00 PiB"),
            (u64::MAX, "16.00 EiB"),
        ];
        for (bytes, text) in table {
            assert_eq!(format_bytes(*bytes), *text, "{bytes}");
        }
    }
}
