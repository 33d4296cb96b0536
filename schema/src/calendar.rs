//! UTC calendar arithmetic on epoch milliseconds, shared by everything that buckets time: the
//! lake's hour partitions, the rollups' billing months, and the enforcer's month-to-date spend.
//! No time-zone database: gpuwarden's hours and months are UTC.

const DAY_MS: i64 = 86_400_000;
const HOUR_MS: i64 = 3_600_000;

/// The start of the UTC hour holding `ts_ms`.
pub fn hour_of(ts_ms: i64) -> i64 {
    ts_ms.div_euclid(HOUR_MS) * HOUR_MS
}

/// The UTC calendar month holding `ts_ms`: (start, end) in ms.
pub fn month_of(ts_ms: i64) -> (i64, i64) {
    let (y, m, _) = civil_from_days(ts_ms.div_euclid(DAY_MS));
    let start = days_from_civil(y, m, 1) * DAY_MS;
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    (start, days_from_civil(ny, nm, 1) * DAY_MS)
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day) (Howard Hinnant's
/// algorithm).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// A proleptic Gregorian date to days since 1970-01-01 (Howard Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_and_months_have_their_lengths() {
        for days in [-800_000, -1, 0, 1, 19_782, 20_000, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        // 2024-02-15: a leap February.
        let (start, end) = month_of(1_707_955_200_000);
        assert_eq!(civil_from_days(start / DAY_MS), (2024, 2, 1));
        assert_eq!((end - start) / DAY_MS, 29);
        // December runs into the next year: 2025-12-06.
        let (start, end) = month_of(1_765_000_000_000);
        assert_eq!(civil_from_days(end / DAY_MS), (2026, 1, 1));
        assert_eq!((end - start) / DAY_MS, 31);
        // 2024-03-15T12:00Z.
        assert_eq!(month_of(1_710_504_000_000).0, 1_709_251_200_000);
        assert_eq!(hour_of(3_599_999), 0);
        assert_eq!(hour_of(-1), -HOUR_MS);
    }
}
