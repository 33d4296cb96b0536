//! Prometheus text exposition helpers shared by every component's `/metrics`, so each of them
//! writes families the same way (`# HELP`, `# TYPE`, escaped label values) and promtool accepts
//! all of them.

use std::fmt::Write as _;

/// Writes one metric family: HELP and TYPE lines, then one line per `(labels, value)`.
/// `labels` is `key="value",…` text without braces; empty for an unlabelled metric.
pub fn family<'a>(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: impl IntoIterator<Item = (&'a str, f64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// Escapes a label value.
pub fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A histogram with fixed bucket bounds (seconds, bytes, …).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending upper bounds; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, value: f64) {
        for (bound, n) in self.bounds.iter().zip(&mut self.buckets) {
            if value <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += value;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Writes the histogram family.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, n) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "X.");
        assert!(out.contains("x_seconds_bucket{le=\"0.1\"} 1\n"));
        assert!(out.contains("x_seconds_bucket{le=\"1\"} 2\n"));
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_seconds_count 3\n"));
    }

    #[test]
    fn families_label_and_escape() {
        let mut out = String::new();
        family(
            &mut out,
            "y_total",
            "counter",
            "Y.",
            [
                ("", 1.0),
                (&format!("k=\"{}\"", escape("a\"b")) as &str, 2.0),
            ],
        );
        assert_eq!(
            out,
            "# HELP y_total Y.\n# TYPE y_total counter\ny_total 1\ny_total{k=\"a\\\"b\"} 2\n"
        );
    }
}
