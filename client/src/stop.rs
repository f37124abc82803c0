//! Stop sequences over streamed text: a piece is released only once it
//! cannot be the start of a stop sequence, so a stream never shows text
//! that the finished answer does not contain.

/// Text of an answer as it streams, cut before the first stop sequence.
#[derive(Debug, Default)]
pub struct StopSequences {
    stops: Vec<String>,
    text: String,
    released: usize,
    stopped: bool,
}

impl StopSequences {
    /// Empty sequences are ignored.
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        StopSequences {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Self::default()
        }
    }

    /// Adds `piece`; returns the text now safe to show and whether a stop
    /// sequence was reached (the answer should end; nothing more is taken).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.text.push_str(piece);
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.released.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match hit {
            Some(at) => {
                self.text.truncate(at);
                self.stopped = true;
                at
            }
            None => self.text.len() - self.partial_stop_suffix(),
        };
        // A stop found inside text already held back never reaches before `released`.
        let end = end.max(self.released);
        let out = self.text[self.released..end].to_string();
        self.released = end;
        (out, self.stopped)
    }

    /// The text held back at the end (it turned out not to start a stop).
    pub fn finish(&mut self) -> String {
        let out = self.text[self.released..].to_string();
        self.released = self.text.len();
        out
    }

    /// Everything so far, up to any stop sequence.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Bytes at the end of the text that begin some stop sequence.
    fn partial_stop_suffix(&self) -> usize {
        self.stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(move |(k, _)| &s[..k]))
            .filter(|prefix| self.text.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, bool) {
        let mut s = StopSequences::new(stops.iter().map(|s| s.to_string()));
        let mut shown = String::new();
        for p in pieces {
            let (out, stop) = s.push(p);
            shown.push_str(&out);
            if stop {
                break;
            }
        }
        shown.push_str(&s.finish());
        (shown, s.text().to_string(), s.stopped())
    }

    #[test]
    fn cuts_before_a_stop_split_across_pieces() {
        let (shown, text, stopped) = run(&["\n\n", "END"], &["Hello", " wor", "ld\n", "\nmore"]);
        assert_eq!(
            (shown.as_str(), text.as_str(), stopped),
            ("Hello world", "Hello world", true)
        );
        let (shown, _, stopped) = run(&["END"], &["abc E", "N", "D tail"]);
        assert_eq!((shown.as_str(), stopped), ("abc ", true));
    }

    #[test]
    fn holds_back_only_what_may_start_a_stop() {
        let mut s = StopSequences::new(["END".to_string()]);
        assert_eq!(s.push("to E"), ("to ".to_string(), false));
        assert_eq!(s.push("x"), ("Ex".to_string(), false));
        assert_eq!(s.finish(), "");
        let (shown, _, stopped) = run(&["é!"], &["caf", "é", " ok"]);
        assert_eq!((shown.as_str(), stopped), ("café ok", false));
        let (shown, _, stopped) = run(&[], &["a", "b"]);
        assert_eq!((shown.as_str(), stopped), ("ab", false));
    }
}
