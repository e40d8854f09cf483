//! Small text helpers: byte sizes in and out, numbers to a few decimals,
//! and plain aligned tables.

/// Formats a byte count with a binary unit (`512 B`, `1.5 KiB`, `2.0 GiB`).
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Parses a byte count: a plain number, or one with a suffix K, M, G, T
/// (binary multiples; `KiB`, `MB`, `GiB`… are read the same way).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => return Err(format!("`{s}`: unknown unit (use a number of bytes, or K, M, G, T)")),
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}`: not a byte count (e.g. 2147483648, 512M or 2G)"))?;
    let bytes = value * mult as f64;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("`{s}`: out of range"));
    }
    Ok(bytes as u64)
}

/// Formats `v` with the decimals of the first `(at_least, decimals)` step it
/// reaches, trying them in order; below every step, as `{:.2e}`.
pub fn fmt_stepped(v: f64, steps: &[(f64, usize)]) -> String {
    match steps.iter().find(|&&(at_least, _)| v >= at_least) {
        Some(&(_, decimals)) => format!("{v:.decimals$}"),
        None => format!("{v:.2e}"),
    }
}

/// Renders rows under a header with columns padded to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(cols) {
            width[i] = width[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                l.push_str("  ");
            }
            l.push_str(cell);
            if i + 1 < cols {
                l.extend(std::iter::repeat_n(' ', width[i].saturating_sub(cell.chars().count())));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    let rule: Vec<String> = width.iter().map(|&w| "-".repeat(w)).collect();
    line(&mut rule.iter().map(String::as_str));
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_parse_and_print() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        assert!(parse_bytes("12parsecs").is_err());
        assert!(parse_bytes("").is_err());
        assert_eq!(fmt_bytes(100), "100 B");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    }

    #[test]
    fn stepped_decimals_follow_the_size() {
        let steps = [(100.0, 0), (10.0, 1)];
        assert_eq!(fmt_stepped(123.4, &steps), "123");
        assert_eq!(fmt_stepped(12.34, &steps), "12.3");
        assert_eq!(fmt_stepped(1.234, &steps), "1.23e0");
        assert_eq!(fmt_stepped(f64::NAN, &steps), "NaN");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(&["a", "bb"], &[vec!["xxx".into(), "y".into()]]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "a    bb");
        assert_eq!(lines[1], "---  --");
        assert_eq!(lines[2], "xxx  y");
    }
}
