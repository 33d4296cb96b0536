//! Who is signed in: the sign-in and sign-out routes, the session cookie, and the [`Signed`]
//! extractor that every other route takes, with its CSRF check.
//!
//! Sign-in checks the token exactly as the API does ([`AppState::login`], failed-login limits
//! included) and is refused when its `Origin` is another site's; the browser then holds a cookie
//! (`HttpOnly`, `SameSite=Strict`, `Secure` when served over TLS) naming the session kept in
//! [`super::state`]. Every form that changes something carries the session's CSRF token,
//! compared in constant time ([`Signed::csrf_ok`]).
//!
//! [`AppState::login`]: crate::web::AppState::login

use std::net::IpAddr;

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Form;
use subtle::ConstantTimeEq;

use super::forms::{CsrfForm, SigninForm};
use super::html::{self, alert, page, see_other, Tab, Who};
use super::state::{Portal, SESSION_LIFETIME};
use crate::policy::Principal;
use crate::web::{source_of, LoginRefusal};

impl Portal {
    fn cookie_name(&self) -> &'static str {
        if self.secure() {
            "__Host-gpuwarden_session"
        } else {
            "gpuwarden_session"
        }
    }

    fn set_cookie(&self, id: &str) -> HeaderValue {
        let secure = if self.secure() { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
            self.cookie_name(),
            SESSION_LIFETIME.as_secs()
        ))
        .expect("a session id is a header value")
    }

    fn clear_cookie(&self) -> HeaderValue {
        let secure = if self.secure() { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{secure}",
            self.cookie_name()
        ))
        .expect("a header value")
    }
}

/// A signed-in person: the session's principal and CSRF token, and what the pages say about the
/// enforcer's clock when it is simulated.
pub(super) struct Signed {
    id: String,
    pub(super) principal: Principal,
    pub(super) csrf: String,
    clock: Option<String>,
}

impl Signed {
    pub(super) fn who(&self) -> Who<'_> {
        Who {
            principal: &self.principal,
            csrf: &self.csrf,
            clock: self.clock.as_deref(),
        }
    }

    /// Whether a form's `csrf` is this session's.
    pub(super) fn csrf_ok(&self, presented: &str) -> bool {
        bool::from(self.csrf.as_bytes().ct_eq(presented.as_bytes()))
    }
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

impl FromRequestParts<Portal> for Signed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, portal: &Portal) -> Result<Self, Response> {
        let session = match cookie(&parts.headers, portal.cookie_name()) {
            Some(id) => portal.session(id).await?.map(|s| (id.to_owned(), s)),
            None => None,
        };
        match session {
            Some((id, s)) => Ok(Signed {
                id,
                principal: s.principal,
                csrf: s.csrf,
                clock: {
                    let clock = portal.service().clock();
                    html::clock_note(
                        clock.speed(),
                        clock.now_ms(),
                        gpuwarden_schema::clock::wall_now_ms(),
                    )
                },
            }),
            None => Err(see_other("/ui/signin")),
        }
    }
}

/// The request's source address, for the failed-login limits.
pub(super) struct Source(Option<IpAddr>);

impl FromRequestParts<Portal> for Source {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _: &Portal,
    ) -> Result<Self, std::convert::Infallible> {
        Ok(Source(source_of(parts)))
    }
}

/// A page for `signed` saying why it cannot be done.
pub(super) fn refused(signed: &Signed, status: StatusCode, title: &str, why: &str) -> Response {
    page(status, title, Some(&signed.who()), Tab::None, &alert(why))
}

/// The page for a form that does not carry this session's CSRF token.
pub(super) fn csrf_refused(signed: &Signed) -> Response {
    refused(
        signed,
        StatusCode::FORBIDDEN,
        "Form expired",
        "This form was not sent from this session's page; go back, reload it and try again.",
    )
}

/// The sign-in form, below `error` when there is one.
fn signin_form(error: Option<&str>) -> String {
    format!(
        r#"{error}<form method="post" action="/ui/signin" class="card" id="signin">
<p>Sign in with the API token an admin gave you. The portal keeps it only for this check: your browser then holds a session cookie, never the token.</p>
<label for="token">API token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required>
<button type="submit">Sign in</button>
</form>"#,
        error = error.map(alert).unwrap_or_default()
    )
}

pub(super) async fn signin_page() -> Response {
    page(
        StatusCode::OK,
        "Sign in",
        None,
        Tab::None,
        &signin_form(None),
    )
}

/// Whether a form came from this site: its `Origin`, when the browser sends one, names the
/// host the request was sent to.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    origin
        .split_once("://")
        .is_some_and(|(_, authority)| !host.is_empty() && authority == host)
}

pub(super) async fn signin(
    State(portal): State<Portal>,
    Source(source): Source,
    headers: HeaderMap,
    Form(form): Form<SigninForm>,
) -> Response {
    if !same_origin(&headers) {
        return page(
            StatusCode::FORBIDDEN,
            "Sign in",
            None,
            Tab::None,
            &signin_form(Some(
                "This sign-in was sent from another site, and was refused.",
            )),
        );
    }
    match portal.app().login(source, Some(&form.token)) {
        Ok(principal) => {
            let id = match portal.open(principal).await {
                Ok(id) => id,
                Err(response) => return response,
            };
            let mut response = see_other("/ui/");
            response
                .headers_mut()
                .insert(header::SET_COOKIE, portal.set_cookie(&id));
            response
        }
        Err(LoginRefusal::Missing) => page(
            StatusCode::UNAUTHORIZED,
            "Sign in",
            None,
            Tab::None,
            &signin_form(Some("Paste your API token to sign in.")),
        ),
        Err(LoginRefusal::Wrong) => page(
            StatusCode::UNAUTHORIZED,
            "Sign in",
            None,
            Tab::None,
            &signin_form(Some(
                "That token is not valid. Check that you pasted all of it; an admin can give you a new one.",
            )),
        ),
        Err(LoginRefusal::LockedOut(locked)) => {
            let mut response = page(
                StatusCode::TOO_MANY_REQUESTS,
                "Sign in",
                None,
                Tab::None,
                &signin_form(Some(&format!(
                    "Too many failed sign-ins; try again in {} s.",
                    locked.retry_after_secs()
                ))),
            );
            if let Ok(v) = HeaderValue::from_str(&locked.retry_after_secs().to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
            response
        }
    }
}

pub(super) async fn signout(
    State(portal): State<Portal>,
    signed: Signed,
    Form(form): Form<CsrfForm>,
) -> Response {
    if !signed.csrf_ok(&form.csrf) {
        return csrf_refused(&signed);
    }
    if let Err(response) = portal.close(&signed.id).await {
        return response;
    }
    let mut response = see_other("/ui/signin");
    response
        .headers_mut()
        .insert(header::SET_COOKIE, portal.clear_cookie());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_found_by_exact_name() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; gpuwarden_session=abc; x_gpuwarden_session=no"),
        );
        assert_eq!(cookie(&headers, "gpuwarden_session"), Some("abc"));
        assert_eq!(cookie(&headers, "session"), None);
    }

    #[test]
    fn a_form_from_another_site_is_not_same_origin() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(same_origin(&headers));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8080"),
        );
        assert!(same_origin(&headers));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(!same_origin(&headers));
        headers.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(!same_origin(&headers));
    }
}
