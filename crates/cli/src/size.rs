//! Human sizes: `10G`, `64M`, `64K`, `4096` (binary units) in and out.

pub fn parse(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, shift) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("size {text:?}: unit must be K, M, G or T")),
            };
            (&text[..i], shift)
        }
        _ => (text, 0),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("size {text:?} is not a number with an optional K/M/G/T unit"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

pub use floe_protocol::units::human_bytes as format;

#[cfg(test)]
mod tests {
    #[test]
    fn parse_and_format() {
        assert_eq!(super::parse("10G"), Ok(10 << 30));
        assert_eq!(super::parse("64k"), Ok(64 << 10));
        assert_eq!(super::parse("4096"), Ok(4096));
        assert!(super::parse("12X").is_err());
        assert!(super::parse("G").is_err());
        assert!(super::parse("99999999999T").is_err());
        assert_eq!(super::format(10 << 30), "10.0 GiB");
        assert_eq!(super::format(512), "512 B");
    }
}
