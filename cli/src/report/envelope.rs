//! The replayed live heap, thinned as it is replayed: what a chart of it needs, in memory that
//! does not grow with the run.
//!
//! Time is cut into spans of equal width; of each span the first, lowest, highest and last
//! moments are kept, in time order. Drawn joined by straight lines, they keep the heap's
//! envelope at any resolution coarser than a span: a spike, a drop and the level the heap stays
//! at after either. When more than [`MAX_SPANS`] spans have been kept, the width doubles and the
//! moments kept are thinned again by the wider spans (the lowest of two lows is the lowest of
//! the pair, and so on), so a run of hours keeps about as many moments as one of a second.

/// A moment of the replay: a time (ns) and the live bytes of each kind then.
pub type Moment = (u64, [u64; 3]);

/// About how many spans are kept (four moments at most each): a chart is a few thousand
/// pixels wide at most, and thins again by its columns.
const MAX_SPANS: usize = 8192;
/// The first width, ns: every moment of a short run is kept.
const FIRST_WIDTH_NS: u64 = 1_000;

/// See the module's documentation.
pub struct Envelope {
    width_ns: u64,
    kept: Vec<Moment>,
    spans_kept: usize,
    span: Option<Span>,
}

/// The moments of the span being filled.
struct Span {
    index: u64,
    first: Moment,
    low: Moment,
    high: Moment,
    last: Moment,
}

/// The live bytes of all kinds (a damaged trace's may reach 2^64 together: they stop there).
pub fn total(kinds: &[u64; 3]) -> u64 {
    kinds.iter().fold(0, |sum: u64, &k| sum.saturating_add(k))
}

impl Default for Envelope {
    fn default() -> Self {
        Envelope { width_ns: FIRST_WIDTH_NS, kept: Vec::new(), spans_kept: 0, span: None }
    }
}

impl Envelope {
    /// Takes in the next moment (moments of several threads may come slightly out of time order:
    /// each opens a span of its own, and the chart sorts them).
    pub fn note(&mut self, moment: Moment) {
        let index = moment.0 / self.width_ns;
        match &mut self.span {
            Some(span) if span.index == index => {
                if total(&moment.1) < total(&span.low.1) {
                    span.low = moment;
                }
                if total(&moment.1) > total(&span.high.1) {
                    span.high = moment;
                }
                span.last = moment;
            }
            _ => {
                self.close_span();
                if self.spans_kept > MAX_SPANS {
                    self.widen();
                }
                self.span = Some(Span { index, first: moment, low: moment, high: moment, last: moment });
            }
        }
    }

    /// The moments kept, in the order they came (time order, but for moments out of order).
    pub fn finish(mut self) -> Vec<Moment> {
        self.close_span();
        self.kept
    }

    fn close_span(&mut self) {
        let Some(span) = self.span.take() else { return };
        let mut moments = [span.first, span.low, span.high, span.last];
        moments.sort_by_key(|m| m.0);
        let mut previous = None;
        for m in moments {
            if previous != Some(m) {
                self.kept.push(m);
                previous = Some(m);
            }
        }
        self.spans_kept += 1;
    }

    /// Doubles the spans' width until the moments kept fit in half of [`MAX_SPANS`] of them.
    fn widen(&mut self) {
        while self.spans_kept > MAX_SPANS / 2 {
            let kept = std::mem::take(&mut self.kept);
            let mut wider = Envelope { width_ns: self.width_ns.saturating_mul(2), ..Envelope::default() };
            for m in kept {
                wider.note(m);
            }
            wider.close_span();
            *self = wider;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(time_ns: u64, bytes: u64) -> Moment {
        (time_ns, [bytes, 0, 0])
    }

    fn envelope(moments: impl IntoIterator<Item = Moment>) -> Vec<Moment> {
        let mut e = Envelope::default();
        for m in moments {
            e.note(m);
        }
        e.finish()
    }

    #[test]
    fn moments_further_apart_than_a_span_are_all_kept() {
        let moments = vec![at(0, 1), at(5_000, 3), at(10_000, 0), at(20_000, 2)];
        assert_eq!(envelope(moments.clone()), moments);
    }

    #[test]
    fn a_span_keeps_its_first_lowest_highest_and_last_in_time_order() {
        // One span of 1 us: up to 9, down to 1, up to 4.
        let kept = envelope([at(100, 5), at(200, 9), at(300, 7), at(400, 1), at(500, 2), at(600, 4)]);
        assert_eq!(kept, [at(100, 5), at(200, 9), at(400, 1), at(600, 4)]);
        // A flat span is one moment, or two.
        assert_eq!(envelope([at(100, 5), at(200, 5)]), [at(100, 5), at(200, 5)]);
        assert_eq!(envelope([at(100, 5)]), [at(100, 5)]);
    }

    #[test]
    fn a_long_run_keeps_a_bounded_envelope_with_its_spike_and_its_drop() {
        // Ten million moments, 1 us apart: a heap that grows by one byte a moment, but for a
        // spike of 10^9 bytes at 3 s and a drop to zero at 7 s, then stays flat from 9 s.
        let bytes = |t: u64| match t {
            3_000_000 => 1_000_000_000,
            7_000_000 => 0,
            t if t >= 9_000_000 => 9_000_000,
            t => t,
        };
        let kept = envelope((0..10_000_000).map(|t| at(t * 1_000, bytes(t))));
        assert!(kept.len() <= 4 * MAX_SPANS, "{}", kept.len());
        assert!(kept.len() >= MAX_SPANS, "{}", kept.len());
        assert!(kept.contains(&at(3_000_000_000, 1_000_000_000)), "the spike");
        assert!(kept.contains(&at(7_000_000_000, 0)), "the drop");
        assert_eq!(kept.first(), Some(&at(0, 0)));
        assert_eq!(kept.last(), Some(&at(9_999_999_000, 9_000_000)));
        assert!(kept.windows(2).all(|w| w[0].0 < w[1].0), "in time order");
    }
}
