//! Duration strings: `90s`, `4m`, `1h`, `1h30m`, `500ms`, `2d`, or a bare number of seconds.

use std::time::Duration;

/// Parse a duration such as `90s`, `4m`, `1h30m`, `1500ms` or `45` (seconds).
///
/// Units (`d`, `h`, `m`, `s`, `ms`) must appear at most once each, largest first; the total must be
/// greater than zero.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("invalid duration '': expected e.g. 90s, 4m, 1h, 1h30m".into());
    }
    let bad = |why: &str| {
        format!("invalid duration '{text}': {why} (expected e.g. 90s, 4m, 1h, 1h30m, 500ms)")
    };
    if s.bytes().all(|b| b.is_ascii_digit()) {
        let secs: u64 = s.parse().map_err(|_| bad("number too large"))?;
        return nonzero(Duration::from_secs(secs)).ok_or_else(|| bad("must be greater than zero"));
    }
    // (unit, milliseconds per unit), largest first.
    const UNITS: [(&str, u64); 5] = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ];
    let mut rest = s;
    let mut total_ms: u64 = 0;
    let mut next_unit = 0usize; // index into UNITS: units must strictly descend
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return Err(bad("expected a number"));
        }
        let value: u64 = rest[..digits]
            .parse()
            .map_err(|_| bad("number too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(|b| b.is_ascii_alphabetic()).count();
        if unit_len == 0 {
            return Err(bad("missing unit after a number"));
        }
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let Some(idx) = UNITS.iter().position(|(u, _)| *u == unit) else {
            return Err(bad(&format!("unknown unit '{unit}'")));
        };
        if idx < next_unit {
            return Err(bad("units must appear once each, largest first"));
        }
        next_unit = idx + 1;
        let ms = value
            .checked_mul(UNITS[idx].1)
            .and_then(|v| total_ms.checked_add(v))
            .ok_or_else(|| bad("too large"))?;
        total_ms = ms;
    }
    nonzero(Duration::from_millis(total_ms)).ok_or_else(|| bad("must be greater than zero"))
}

fn nonzero(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

/// Short human form: `1h30m`, `90ms`, `4m5s`.
pub fn format_duration(d: Duration) -> String {
    let total_ms = d.as_millis();
    if total_ms < 1000 {
        return format!("{total_ms}ms");
    }
    let mut secs = d.as_secs();
    let mut out = String::new();
    for (unit, size) in [("d", 86_400u64), ("h", 3_600), ("m", 60)] {
        if secs >= size {
            out.push_str(&format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    if secs > 0 || out.is_empty() {
        out.push_str(&format!("{secs}s"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("4m"), Ok(Duration::from_secs(240)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(
            parse_duration("1m30s250ms"),
            Ok(Duration::from_millis(90_250))
        );
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
    }

    #[test]
    fn rejects_bad_forms() {
        for bad in [
            "",
            "s",
            "10x",
            "1.5h",
            "30m1h",
            "1h1h",
            "0s",
            "0",
            "-5s",
            "5 s",
            "h30",
            "99999999999999999999s",
        ] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(err.contains("invalid duration"), "{bad}: {err}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_duration(Duration::from_secs(5400)), "1h30m");
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::from_secs(65)), "1m5s");
        assert_eq!(format_duration(Duration::from_secs(0)), "0ms");
    }
}
