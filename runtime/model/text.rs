//! Streaming detokenization: token bytes in, complete UTF-8 text out, with stop strings held back
//! until they can no longer match (a stop string is never printed).

/// Turns a stream of byte pieces into text, never splitting a UTF-8 character.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Append bytes; return the text that is now complete (invalid bytes become U+FFFD).
    pub fn push(&mut self, bytes: &[u8], out: &mut String) {
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: re-validate the valid prefix.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or(""),
                    );
                    start += valid;
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start += n;
                        }
                        None => break, // incomplete character: wait for more bytes
                    }
                }
            }
        }
        self.pending.drain(..start);
    }

    /// Flush at end of stream: an incomplete tail becomes U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        if !self.pending.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
    }
}

/// Holds back text that could be the start of a stop string.
pub struct StopFilter {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopFilter {
    /// A filter for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopFilter {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string was seen (nothing more is passed through).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Add text; returns the part safe to print. After a stop string, returns the text before it and
    /// `stopped()` becomes true.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// End of generation: release what was held.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_pieces() {
        let mut s = Utf8Stream::default();
        let mut out = String::new();
        let e = "é€😀".as_bytes();
        for b in e {
            s.push(&[*b], &mut out);
        }
        assert_eq!(out, "é€😀");
        let mut out = String::new();
        s.push(&[b'a', 0xFF, b'b', 0xE2], &mut out);
        assert_eq!(out, "a\u{FFFD}b");
        s.finish(&mut out);
        assert_eq!(out, "a\u{FFFD}b\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_held_and_cut() {
        let mut f = StopFilter::new(vec!["<|im_end|>".into(), "\n\n".into()]);
        let mut printed = String::new();
        for piece in ["Hello", " world", "<|im", "_end|>", "more"] {
            printed += &f.push(piece);
        }
        assert!(f.stopped());
        assert_eq!(printed, "Hello world");
        let mut f = StopFilter::new(vec!["STOP".into()]);
        let mut p = f.push("aST");
        assert_eq!(p, "a");
        p += &f.push("x");
        p += &f.finish();
        assert_eq!(p, "aSTx");
    }
}
