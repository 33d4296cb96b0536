//! The portal's HTML: the one escaping function every shown value goes through ([`e`]), the page
//! layout, redirects and failures, and the formats of money, durations, times and query values.
//!
//! Pages are written with `format!`; a value that is not a literal of this crate is written as
//! `{}` of [`e`]`(value)`, which escapes `& < > " '`, so team, user, project and label values
//! (user input) are shown as text, in element content and in quoted attributes alike. The pages
//! load no inline script and no inline style; the Content-Security-Policy header says so to
//! the browser ([`page`]).

use std::fmt::{self, Display, Write as _};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use gpuwarden_schema::config::Role;

use crate::policy::Principal;
use crate::service::ServiceError;
use crate::web::ApiError;

/// `value`, displayed with `& < > " '` escaped for HTML text and quoted attributes.
pub(crate) fn e<T: Display>(value: T) -> Escaped<T> {
    Escaped(value)
}

/// A value whose `Display` is escaped; see [`e`].
pub(crate) struct Escaped<T>(T);

impl<T: Display> Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Escaper(f);
        write!(out, "{}", self.0)
    }
}

struct Escaper<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl fmt::Write for Escaper<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut last = 0;
        for (i, c) in s.char_indices() {
            let entity = match c {
                '&' => "&amp;",
                '<' => "&lt;",
                '>' => "&gt;",
                '"' => "&quot;",
                '\'' => "&#39;",
                _ => continue,
            };
            self.0.write_str(&s[last..i])?;
            self.0.write_str(entity)?;
            last = i + 1;
        }
        self.0.write_str(&s[last..])
    }
}

/// Money as people read it: `$1,234.50`.
pub(crate) fn usd(x: f64) -> String {
    let negative = x < 0.0;
    let cents = (x.abs() * 100.0).round() as u64;
    let (whole, frac) = (cents / 100, cents % 100);
    let digits = whole.to_string();
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    format!("{}${grouped}.{frac:02}", if negative { "-" } else { "" })
}

/// A span of milliseconds in the two largest units: `2h 5m`, `3d 4h`, `45s`.
pub(crate) fn span(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    let (d, h, m) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, m) => format!("{m}m"),
        (0, h, 0) => format!("{h}h"),
        (0, h, m) => format!("{h}h {m}m"),
        (d, 0, _) => format!("{d}d"),
        (d, h, _) => format!("{d}d {h}h"),
    }
}

/// A time as UTC, to the minute: `2026-01-10 14:05 UTC`.
pub(crate) fn at(ms: i64) -> String {
    let text = humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64),
    )
    .to_string();
    // 2026-01-10T14:05:09Z
    format!("{} {} UTC", &text[..10], &text[11..16])
}

/// Where a signed-in person is, for the navigation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tab {
    Request,
    Leases,
    Team,
    Admin,
    Scorecard,
    None,
}

/// The signed-in principal and the session's CSRF token, as a page needs them, and what to say
/// about the enforcer's clock ([`clock_note`]).
pub(crate) struct Who<'a> {
    pub(crate) principal: &'a Principal,
    pub(crate) csrf: &'a str,
    pub(crate) clock: Option<&'a str>,
}

/// A whole page: `title`, the navigation for `who` (none before sign-in) with `tab` marked, and
/// `body` (already escaped HTML), answered with `status` and the portal's security headers.
pub(crate) fn page(
    status: StatusCode,
    title: &str,
    who: Option<&Who<'_>>,
    tab: Tab,
    body: &str,
) -> Response {
    let mut nav = String::new();
    let clock = who
        .and_then(|w| w.clock)
        .map(|note| format!(r#"<p class="clock" id="clock" role="note">{}</p>"#, e(note)))
        .unwrap_or_default();
    if let Some(who) = who {
        let p = who.principal;
        let mut links: Vec<(Tab, &str, &str)> = Vec::new();
        if p.role != Role::Viewer {
            links.push((Tab::Request, "/ui/request", "Request GPUs"));
        }
        links.push((Tab::Leases, "/ui/leases", "My leases"));
        links.push((Tab::Team, "/ui/team", "My team"));
        if p.role == Role::Admin {
            links.push((Tab::Admin, "/ui/admin", "Admin"));
            links.push((Tab::Scorecard, "/ui/scorecard", "Scorecard"));
        }
        let _ = write!(nav, r#"<nav aria-label="Portal"><ul>"#);
        for (t, href, label) in links {
            let current = if t == tab {
                r#" aria-current="page""#
            } else {
                ""
            };
            let _ = write!(nav, r#"<li><a href="{href}"{current}>{label}</a></li>"#);
        }
        let _ = write!(
            nav,
            r#"</ul><form method="post" action="/ui/signout" class="signout"><input type="hidden" name="csrf" value="{csrf}"><span class="who">{name} ({role})</span> <button type="submit">Sign out</button></form></nav>"#,
            csrf = e(who.csrf),
            name = e(&p.name),
            role = role_name(p.role),
        );
    }
    let html = format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · gpuwarden</title>
<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml">
<link rel="stylesheet" href="/ui/static/portal.css">
<script src="/ui/static/portal.js" defer></script>
</head>
<body>
<header><a class="brand" href="/ui/">gpuwarden</a>{nav}</header>
<main>
{clock}<h1>{title}</h1>
{body}
</main>
</body>
</html>
"#,
        title = e(title),
    );
    let mut response = (status, html).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    secure_headers(headers);
    response
}

/// The headers every portal answer carries: no inline script or style, no framing, no caching
/// of pages that show a person's leases and spend, and no referrer sent to other sites (within
/// the portal the browser then sends the page's `Origin` with a form, which sign-in checks; with
/// `no-referrer` it would send `null`).
pub(crate) fn secure_headers(headers: &mut axum::http::HeaderMap) {
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
}

/// What the pages say about the enforcer's clock when it is not the wall clock (`--speed` or
/// `--start` of `gpuwarden up`, the demo, a test's hand-set clock), given its `speed` (event ms
/// per wall ms), its reading `now_ms` and the wall clock's `wall_ms`: every time and span the
/// pages show is on it, and without a word a person reads times in the future. None for a
/// clock that keeps real time.
pub(crate) fn clock_note(speed: f64, now_ms: i64, wall_ms: i64) -> Option<String> {
    let reads = at(now_ms);
    if speed <= 0.0 || !speed.is_finite() {
        return Some(format!(
            "Simulated time: the enforcer's clock is set by hand and reads {reads}; every time on \
             these pages is on that clock."
        ));
    }
    if speed != 1.0 {
        // An hour of simulated time, in real time.
        let hour = span((3_600_000.0 / speed).round() as i64);
        return Some(format!(
            "Simulated time: the enforcer's clock runs at {speed}× real time (an hour every \
             {hour}) and reads {reads}; every time, age and cost on these pages is on that clock."
        ));
    }
    let drift = now_ms - wall_ms;
    (drift.abs() > 60_000).then(|| {
        format!(
            "Simulated time: the enforcer's clock reads {reads}, {} {} real time; every time on \
             these pages is on that clock.",
            span(drift.abs()),
            if drift > 0 { "ahead of" } else { "behind" }
        )
    })
}

/// A role's name.
pub(crate) fn role_name(role: Role) -> &'static str {
    match role {
        Role::Admin => "admin",
        Role::Member => "member",
        Role::Service => "service",
        Role::Viewer => "viewer",
    }
}

/// A redirect to `to` (a portal path) with the portal's security headers: what a form answers
/// when it succeeded, so that a reload does not send it again.
pub(crate) fn see_other(to: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    response.headers_mut().insert(
        header::LOCATION,
        HeaderValue::from_str(to).expect("a portal path is a header value"),
    );
    secure_headers(response.headers_mut());
    response
}

/// A service error as a status and a sentence for the page; an internal failure is logged and
/// told only as such.
pub(crate) fn failure(e: ServiceError) -> (StatusCode, String) {
    let e = ApiError::from(e);
    let message = match &e {
        ApiError::Internal(detail) => {
            tracing::error!(error = %detail, "portal request failed");
            "the enforcer failed; try again, and tell an admin if it goes on".to_owned()
        }
        other => other.to_string(),
    };
    (e.status(), message)
}

/// The page for a shared store that could not be reached (503, try again).
pub(crate) fn store_failed(e: ServiceError) -> Response {
    tracing::warn!(error = %e, "the portal could not reach the lease store");
    let mut response = page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Unavailable",
        None,
        Tab::None,
        "<p>The enforcer cannot reach its database just now. Try again in a moment.</p>",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// `text` for a query string: letters, digits, `-` and `_` as they are, anything else
/// percent-encoded.
pub(crate) fn query_value(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A paragraph saying something went wrong, for a screen reader too.
pub(crate) fn alert(message: &str) -> String {
    format!(r#"<p class="error" role="alert">{}</p>"#, e(message))
}

/// A paragraph saying something went right.
pub(crate) fn notice(message: &str) -> String {
    format!(r#"<p class="notice" role="status">{}</p>"#, e(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_turns_markup_into_text() {
        assert_eq!(
            e(r#"<script>alert("x")</script> & 'y'"#).to_string(),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
        assert_eq!(e("plain ü text").to_string(), "plain ü text");
        assert_eq!(e("").to_string(), "");
        // Through any Display, not only strings.
        assert_eq!(e(format_args!("{}<", 1)).to_string(), "1&lt;");
    }

    #[test]
    fn money_spans_and_times_read_as_people_write_them() {
        assert_eq!(usd(412.0), "$412.00");
        assert_eq!(usd(5000.0), "$5,000.00");
        assert_eq!(usd(1_234_567.891), "$1,234,567.89");
        assert_eq!(usd(-12.5), "-$12.50");
        assert_eq!(span(45_000), "45s");
        assert_eq!(span(2 * 3_600_000 + 5 * 60_000), "2h 5m");
        assert_eq!(span(3 * 86_400_000 + 4 * 3_600_000), "3d 4h");
        assert_eq!(span(-5), "0s");
        assert_eq!(at(1_767_225_600_000), "2026-01-01 00:00 UTC");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(query_value("0193-ab_C"), "0193-ab_C");
        assert_eq!(query_value("a b&c"), "a%20b%26c");
    }

    #[test]
    fn a_clock_that_is_not_real_time_is_named_with_its_speed() {
        let now = 1_767_225_600_000;
        assert_eq!(clock_note(1.0, now, now + 5_000), None);
        assert_eq!(
            clock_note(60.0, now, now).as_deref(),
            Some(
                "Simulated time: the enforcer's clock runs at 60× real time (an hour every 1m) \
                 and reads 2026-01-01 00:00 UTC; every time, age and cost on these pages is on \
                 that clock."
            )
        );
        let ahead = clock_note(1.0, now, now - 3 * 3_600_000).unwrap();
        assert!(ahead.contains("3h ahead of real time"), "{ahead}");
        let still = clock_note(0.0, now, now).unwrap();
        assert!(still.contains("set by hand"), "{still}");
    }
}
