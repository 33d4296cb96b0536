//! The portal in a real browser: Debian's headless Chromium driven through Debian's
//! chromedriver (WebDriver, with the fantoccini client), against `gpuwarden enforce` or
//! `gpuwarden demo` on a free port. Each test starts its own chromedriver and its own enforcer.
//!
//! - a member signs in, watches the estimate follow the GPU count, is admitted within quota and
//!   refused over it (with the reason in words and the model priced), sees a label holding
//!   `<script>` as text and the lease's id and model on one line at 1280 px, and releases the
//!   lease, which the admin's audit trail shows as hers; a wrong token is refused; signing out
//!   ends the session;
//! - on a phone (375 px, emulated: headless Chromium makes no window narrower than 500 px) a
//!   denial is told in the first screen, above the form;
//! - a viewer has no request form, a member cannot see another team, only admins see the admin
//!   pages;
//! - the demo's scorecard, after a run, scores runtime enforcement from its reclaims, as
//!   `gpuwarden assess` does; its pages say the clock is simulated (60×); every page is
//!   photographed at desktop (1280 px) and phone (375 px) widths into
//!   `$CARGO_TARGET_TMPDIR/portal-shots/`.
//!
//! Every page load is checked for JavaScript errors in the browser's log.

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use support::{http, Config, Demo, Running, Substrate, Team, Workload, H100};

const ADA: &str = "portal-test-ada-token";
const EVE: &str = "portal-test-eve-token";
const WATCHER: &str = "portal-test-watcher-token";
const ROOT: &str = "portal-test-root-token";

/// Team ml (quota 4, members ada and bob), team cv (eve); one simulated host of 8 H100s at
/// $4 a GPU-hour; tokens for ada and eve (members), a viewer of ml and an admin.
fn write_config(dir: &Path) -> PathBuf {
    Config::new()
        .kafka("embedded")
        .data_dir(&dir.join("data"))
        .pricing(2.0)
        .gpu_price("H100", 4.0)
        .team(Team::new("ml", 4, 1000.0).members(&["ada", "bob"]))
        .team(Team::new("cv", 4, 1000.0).members(&["eve"]))
        .workload(Workload::new("training").max_gpus(8).max_duration("24h"))
        .enforcer()
        .substrate(Substrate::simulated("sim").hosts("h", 1, 8, H100))
        .token("ada", ADA, "member", &["ml"])
        .token("eve", EVE, "member", &["cv"])
        .token("watcher", WATCHER, "viewer", &["ml"])
        .token("root", ROOT, "admin", &[])
        .write(dir.join("gpuwarden.toml"))
}

/// `gpuwarden enforce` on `config`: the process and its API's `host:port`.
fn start_enforcer(config: &Path) -> (Running, String) {
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_string();
    let address = api.strip_prefix("http://").expect("plain HTTP").to_string();
    (enforcer, address)
}

/// Debian's chromedriver on a free port of 127.0.0.1, stopped when dropped.
struct Chromedriver {
    child: Child,
    url: String,
}

impl Chromedriver {
    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "chromedriver runs (Debian: apt-get install chromium chromium-driver; .ci/run installs them)",
            );
        let url = format!("http://127.0.0.1:{port}");
        let address = format!("127.0.0.1:{port}");
        // Listening means ready: chromedriver binds its port once it can take sessions.
        support::eventually("chromedriver listens", Duration::from_secs(30), || {
            std::net::TcpStream::connect(&address).map_err(|e| format!("{address}: {e}"))
        });
        Self { child, url }
    }

    /// A new headless Chromium session whose page is `width` CSS pixels wide: a window that
    /// wide, or, below the 500 px headless Chromium makes any window at least, a phone's screen
    /// emulated over it.
    async fn browser(&self, width: u32) -> Browser {
        let options = json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     format!("--window-size={width},900"), "--lang=en-US"],
        });
        let capabilities = json!({
            "browserName": "chrome",
            "goog:chromeOptions": options,
            "goog:loggingPrefs": {"browser": "ALL"},
        });
        let Value::Object(capabilities) = capabilities else {
            unreachable!()
        };
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .expect("a Chromium session");
        let browser = Browser { client, width };
        browser.viewport(SCREEN_HEIGHT).await;
        browser
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A POST to an endpoint of chromedriver's own under the session, which WebDriver itself lacks:
/// `se/log` (the browser's log), `goog/cdp/execute` (a DevTools command).
#[derive(Debug)]
struct SessionPost {
    path: &'static str,
    body: Value,
}

impl SessionPost {
    fn browser_log() -> Self {
        Self {
            path: "se/log",
            body: json!({"type": "browser"}),
        }
    }

    fn cdp(cmd: &str, params: Value) -> Self {
        Self {
            path: "goog/cdp/execute",
            body: json!({"cmd": cmd, "params": params}),
        }
    }
}

impl WebDriverCompatibleCommand for SessionPost {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!(
            "session/{}/{}",
            session_id.unwrap_or_default(),
            self.path
        ))
    }

    fn method_and_body(&self, _: &url::Url) -> (axum::http::Method, Option<String>) {
        (axum::http::Method::POST, Some(self.body.to_string()))
    }
}

/// The height of the browser's screen, CSS pixels: what a page shows before scrolling.
const SCREEN_HEIGHT: u32 = 900;

/// Headless Chromium makes no window narrower than this; a phone's width is emulated.
const NARROWEST_WINDOW: u32 = 500;

struct Browser {
    client: Client,
    width: u32,
}

impl Browser {
    /// Makes the page `self.width` by `height` CSS pixels: the window, or below
    /// [`NARROWEST_WINDOW`] an emulated phone's screen (with its viewport meta tag honoured).
    async fn viewport(&self, height: u32) {
        if self.width >= NARROWEST_WINDOW {
            self.client
                .set_window_size(self.width, height)
                .await
                .unwrap();
            return;
        }
        self.client
            .issue_cmd(SessionPost::cdp(
                "Emulation.setDeviceMetricsOverride",
                json!({"width": self.width, "height": height, "deviceScaleFactor": 1, "mobile": true}),
            ))
            .await
            .unwrap();
    }

    async fn goto(&self, base: &str, path: &str) {
        self.client
            .goto(&format!("http://{base}{path}"))
            .await
            .unwrap();
        self.no_js_errors().await;
    }

    /// Fails on any error the page's scripts logged since the last look (the log is read, and
    /// so emptied, each time): exceptions, console errors, refused scripts or styles, and a
    /// stylesheet, script or icon of the portal's that failed to load. The network's other
    /// entries are left out: a refusal page's 401 or 403 is logged there, and is what a test
    /// asks for.
    async fn no_js_errors(&self) {
        let log = self
            .client
            .issue_cmd(SessionPost::browser_log())
            .await
            .unwrap();
        let severe: Vec<&Value> = log
            .as_array()
            .map(|entries| {
                entries
                    .iter()
                    .filter(|e| {
                        e["level"] == "SEVERE"
                            && (e["source"] != "network"
                                || e["message"]
                                    .as_str()
                                    .is_some_and(|m| m.contains("/ui/static/")))
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert!(severe.is_empty(), "JavaScript errors: {severe:#?}");
    }

    async fn text(&self, css: &str) -> String {
        match self.client.find(Locator::Css(css)).await {
            Ok(element) => element.text().await.unwrap(),
            Err(e) => panic!(
                "{css}: {e}\n--- the page, {}:\n{}",
                self.path().await,
                self.main().await
            ),
        }
    }

    /// The page's main text, for failure messages.
    async fn main(&self) -> String {
        match self.client.find(Locator::Css("main")).await {
            Ok(main) => main.text().await.unwrap_or_default(),
            Err(_) => self.client.source().await.unwrap_or_default(),
        }
    }

    async fn exists(&self, css: &str) -> bool {
        !self
            .client
            .find_all(Locator::Css(css))
            .await
            .unwrap()
            .is_empty()
    }

    async fn fill(&self, id: &str, value: &str) {
        let field = self.client.find(Locator::Id(id)).await.unwrap();
        field.clear().await.unwrap();
        field.send_keys(value).await.unwrap();
    }

    /// Clicks `css`, which submits a form or follows a link, and waits for the next page: the
    /// old document is marked, and the new one is there once the mark is gone and it has
    /// loaded (a click may return before the browser has left the page).
    async fn click(&self, css: &str) {
        self.client
            .execute("window.__leaving = true;", vec![])
            .await
            .unwrap();
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .click()
            .await
            .unwrap();
        let started = Instant::now();
        loop {
            let arrived = self
                .client
                .execute(
                    "return window.__leaving === undefined && document.readyState === 'complete';",
                    vec![],
                )
                .await;
            if matches!(arrived, Ok(Value::Bool(true))) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "clicking {css} led to no new page"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.no_js_errors().await;
    }

    /// How many lines each element `css` picks takes (its client rectangles: one per line box
    /// an inline element spans).
    async fn lines(&self, css: &str) -> Vec<u64> {
        let counts = self
            .client
            .execute(
                "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.getClientRects().length);",
                vec![json!(css)],
            )
            .await
            .unwrap();
        counts
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect()
    }

    /// Whether all of element `css` is in the window as the page opened, without scrolling.
    async fn in_first_screen(&self, css: &str) -> bool {
        self.client
            .execute(
                "const r = document.querySelector(arguments[0]).getBoundingClientRect(); \
                 return window.scrollY === 0 && r.top >= 0 && r.bottom <= window.innerHeight;",
                vec![json!(css)],
            )
            .await
            .unwrap()
            == json!(true)
    }

    /// Whether element `css` is in the window where it is scrolled to now.
    async fn in_first_screen_scrolled(&self, css: &str) -> bool {
        self.client
            .execute(
                "const r = document.querySelector(arguments[0]).getBoundingClientRect(); \
                 return r.top >= 0 && r.bottom <= window.innerHeight;",
                vec![json!(css)],
            )
            .await
            .unwrap()
            == json!(true)
    }

    /// Whether every element `css` picks shows all its content without scrolling sideways.
    async fn fit(&self, css: &str) -> bool {
        self.client
            .execute(
                "return Array.from(document.querySelectorAll(arguments[0])).every(e => e.scrollWidth <= e.clientWidth);",
                vec![json!(css)],
            )
            .await
            .unwrap()
            == json!(true)
    }

    /// The texts of every element `css` picks.
    async fn texts(&self, css: &str) -> Vec<String> {
        let mut out = Vec::new();
        for element in self.client.find_all(Locator::Css(css)).await.unwrap() {
            out.push(element.text().await.unwrap());
        }
        out
    }

    async fn path(&self) -> String {
        self.client.current_url().await.unwrap().path().to_string()
    }

    /// Waits until `css`'s text satisfies `wanted` (what the live estimate needs: it is
    /// fetched after the fields change), and returns it.
    async fn text_until(&self, css: &str, wanted: impl Fn(&str) -> bool) -> String {
        let started = Instant::now();
        loop {
            let text = self.text(css).await;
            if wanted(&text) {
                return text;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{css} never read as wanted; it reads {text:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn sign_in(&self, base: &str, token: &str) {
        self.goto(base, "/ui/signin").await;
        self.fill("token", token).await;
        self.click("#signin button").await;
    }

    async fn sign_out(&self) {
        self.click("form.signout button").await;
    }

    /// A screenshot of the whole page, `name-<width>.png` in `dir`: the window (or emulated
    /// screen) is made as tall as the page (plus what the window itself takes), then put back.
    async fn shoot(&self, dir: &Path, name: &str) {
        let frame = if self.width >= NARROWEST_WINDOW {
            "window.outerHeight - window.innerHeight"
        } else {
            "0"
        };
        let height = self
            .client
            .execute(
                &format!("return document.documentElement.scrollHeight + {frame};"),
                vec![],
            )
            .await
            .unwrap()
            .as_u64()
            .unwrap_or(900)
            .clamp(600, 6000) as u32;
        self.viewport(height).await;
        let png = self.client.screenshot().await.unwrap();
        self.viewport(SCREEN_HEIGHT).await;
        std::fs::write(dir.join(format!("{name}-{}.png", self.width)), png).unwrap();
        // No page is wider than the window: nothing to scroll sideways on a phone.
        let fits = self
            .client
            .execute(
                "return document.documentElement.scrollWidth <= window.innerWidth;",
                vec![],
            )
            .await
            .unwrap();
        assert_eq!(
            fits,
            json!(true),
            "{name} scrolls sideways at {} px",
            self.width
        );
    }
}

fn api_json(base: &str, method: &str, path: &str, token: &str, body: Option<&str>) -> Value {
    let (status, text) = http(base, method, path, Some(token), body);
    assert_eq!(status, 200, "{method} {path}: {text}");
    serde_json::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_asks_sees_the_estimate_is_refused_over_quota_and_releases() {
    let dir = tempfile::tempdir().unwrap();
    let (_enforcer, base) = start_enforcer(&write_config(dir.path()));
    let driver = Chromedriver::start();
    let b = driver.browser(1280).await;

    // Signed out, every page leads to the sign-in form; a wrong token is refused there.
    b.goto(&base, "/ui/leases").await;
    assert_eq!(b.path().await, "/ui/signin");
    b.sign_in(&base, "not-a-token").await;
    assert!(
        b.text("p.error").await.contains("That token is not valid"),
        "{}",
        b.text("main").await
    );
    b.sign_in(&base, ADA).await;
    assert_eq!(b.path().await, "/ui/request");
    // The session cookie is out of the scripts' reach, and the token is nowhere in it.
    let cookies = b
        .client
        .execute("return document.cookie;", vec![])
        .await
        .unwrap();
    assert_eq!(cookies, json!(""));
    let jar = b.client.get_all_cookies().await.unwrap();
    let session = jar
        .iter()
        .find(|c| c.name() == "gpuwarden_session")
        .expect("a session cookie");
    assert_eq!(session.http_only(), Some(true));
    assert_eq!(format!("{:?}", session.same_site()), "Some(Strict)");
    assert!(!session.value().contains(ADA));
    assert_eq!(b.text("#user").await, "ada");
    // Only the workloads the config defines are offered; the clock is real, so not named.
    let workloads: Vec<String> = {
        let mut out = Vec::new();
        for option in b
            .client
            .find_all(Locator::Css("#workload option"))
            .await
            .unwrap()
        {
            out.push(option.attr("value").await.unwrap().unwrap_or_default());
        }
        out
    };
    assert_eq!(workloads, ["training"]);
    assert!(!b.exists("#clock").await);

    // The estimate follows the GPU count: $4 a GPU-hour, for 2 h.
    b.fill("project", "llm").await;
    b.fill("duration", "2h").await;
    b.fill("gpus", "1").await;
    // Each field's estimate arrives on its own: wait for the one that has seen all three.
    let one = b
        .text_until("#estimate-summary", |t| {
            t.contains("= $4.00/h") && t.contains("for 2h")
        })
        .await;
    assert!(one.starts_with("Would be admitted"), "{one}");
    assert!(one.contains("up to $8.00 for 2h"), "{one}");
    b.fill("gpus", "2").await;
    let two = b
        .text_until("#estimate-summary", |t| t.contains("= $8.00/h"))
        .await;
    assert!(two.contains("up to $16.00 for 2h"), "{two}");
    // Over the quota of 4, the estimate already says why, in words, and what would pass.
    b.fill("gpus", "5").await;
    b.text_until("#estimate-summary", |t| t.starts_with("Would be denied"))
        .await;
    let reason = b
        .text("#estimate-reasons li[data-code='quota_exceeded']")
        .await;
    assert!(
        reason.contains("The team has 4 of 4 GPUs free")
            && reason.contains("Ask for 4 GPUs or fewer"),
        "{reason}"
    );
    // The dry runs held nothing.
    let team = api_json(&base, "GET", "/v1/teams/ml", ADA, None);
    assert_eq!(team["gpus_held"], 0, "{team}");

    // Within quota: admitted, with a label that is markup, shown as text.
    b.fill("gpus", "2").await;
    b.fill("labels", "note=<script>window.pwned = 1</script>")
        .await;
    b.click("#ask").await;
    let decision = b.text("#decision").await;
    assert!(decision.contains("admitted"), "{decision}");
    b.click("nav a[href='/ui/leases']").await;
    let label = b.text("#open-leases .label-pill").await;
    assert_eq!(label, "note=<script>window.pwned = 1</script>");
    assert_eq!(
        b.client
            .execute("return typeof window.pwned;", vec![])
            .await
            .unwrap(),
        json!("undefined")
    );
    assert!(b.text("#open-leases").await.contains("2 × NVIDIA H100"));
    // At a desktop's width the lease id and the model name read on one line each.
    assert_eq!(b.lines("#open-leases code.id").await, [1]);
    assert_eq!(b.lines("#open-leases .model").await, [1]);
    assert!(
        b.fit(".table-wrap").await,
        "the leases table is wider than the page"
    );
    let team = api_json(&base, "GET", "/v1/teams/ml", ADA, None);
    assert_eq!(team["gpus_held"], 2, "{team}");
    let lease_id = api_json(&base, "GET", "/v1/leases?state=active", ADA, None)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The team page says where each figure comes from: the enforcer counts spend up to now,
    // the lake's rollups (none here) have no idle cost yet, rather than "$0.00 of $0.00".
    b.goto(&base, "/ui/team").await;
    let source = b.text("#spend-source").await;
    assert!(
        source.starts_with("Counted by the enforcer up to now"),
        "{source}"
    );
    let idle = b.text("#idle").await;
    assert!(idle.contains("hourly rollups have not run yet"), "{idle}");

    // Over quota (2 held + 3 > 4): refused, every reason in words, nothing created.
    b.goto(&base, "/ui/request").await;
    b.fill("project", "llm").await;
    b.fill("gpus", "3").await;
    b.click("#ask").await;
    let summary = b.text("#estimate-summary").await;
    assert!(summary.starts_with("Denied: 1 reason"), "{summary}");
    // The denial names the model it priced, as an admission does.
    assert!(
        summary.contains("3 GPUs of NVIDIA H100 80GB HBM3 × $4.00/h"),
        "{summary}"
    );
    let decision = b.text("#decision").await;
    assert!(
        decision.starts_with("Denied: The team has 2 of 4 GPUs free"),
        "{decision}"
    );
    let reason = b
        .text("#estimate-reasons li[data-code='quota_exceeded']")
        .await;
    assert!(
        reason.contains("The team has 2 of 4 GPUs free (2 held in open leases); you asked for 3.")
            && reason.contains("Ask for 2 GPUs or fewer, or release a lease first."),
        "{reason}"
    );
    let leases = api_json(&base, "GET", "/v1/leases?state=active", ADA, None);
    assert_eq!(leases.as_array().unwrap().len(), 1, "{leases}");

    // Release it from the leases page.
    b.goto(&base, "/ui/leases").await;
    b.click("#open-leases button.danger").await;
    assert!(b.text("p.notice").await.contains("released"));
    assert!(b.exists("#no-leases").await);
    assert!(
        b.text("#ended-leases").await.contains("released by ada"),
        "{}",
        b.text("#ended-leases").await
    );
    let team = api_json(&base, "GET", "/v1/teams/ml", ADA, None);
    assert_eq!(team["gpus_held"], 0, "{team}");

    // Signing out ends the session: the pages lead to the sign-in form again.
    b.sign_out().await;
    assert_eq!(b.path().await, "/ui/signin");
    b.goto(&base, "/ui/request").await;
    assert_eq!(b.path().await, "/ui/signin");

    // The audit trail shows ada's release as hers, not as a reclaim the system took.
    b.sign_in(&base, ROOT).await;
    b.goto(&base, "/ui/admin").await;
    let row = format!("#actions tr[data-lease='{lease_id}']");
    let actions = b.texts(&format!("{row} td.action")).await;
    assert!(
        actions.contains(&"release".to_string()) && !actions.contains(&"reclaim".to_string()),
        "{}",
        b.text("#actions").await
    );
    let rows = b.texts(&row).await;
    assert!(
        rows.iter()
            .any(|r| r.contains("release") && r.contains("by ada, its holder")),
        "{rows:?}"
    );
    b.client.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_phone_a_denial_is_told_at_the_top_of_the_page() {
    let dir = tempfile::tempdir().unwrap();
    let (_enforcer, base) = start_enforcer(&write_config(dir.path()));
    let driver = Chromedriver::start();
    let b = driver.browser(375).await;
    b.sign_in(&base, ADA).await;
    let width = b
        .client
        .execute("return window.innerWidth;", vec![])
        .await
        .unwrap();
    assert_eq!(width, json!(375), "a phone's width");
    b.fill("project", "llm").await;
    b.fill("gpus", "5").await;
    b.click("#ask").await;
    // The estimate, with every reason, is below the form, out of the first screen; the notice
    // at the top says the request was denied and why, as an admission's says it was admitted.
    assert!(!b.in_first_screen("#estimate").await);
    assert!(b.in_first_screen("#decision").await);
    let decision = b.text("#decision").await;
    assert!(
        decision.starts_with(
            "Denied: The team has 4 of 4 GPUs free (0 held in open leases); you asked for 5."
        ),
        "{decision}"
    );
    // Its link leads to the reasons.
    b.client
        .find(Locator::Css("#decision a"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(b.in_first_screen_scrolled("#estimate-title").await);
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("portal-shots");
    std::fs::create_dir_all(&shots).unwrap();
    b.client
        .execute("window.scrollTo(0, 0);", vec![])
        .await
        .unwrap();
    let png = b.client.screenshot().await.unwrap();
    std::fs::write(shots.join("request-denied-first-screen-375.png"), png).unwrap();
    b.client.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_has_no_request_form_and_a_member_sees_only_their_teams() {
    let dir = tempfile::tempdir().unwrap();
    let (_enforcer, base) = start_enforcer(&write_config(dir.path()));
    let driver = Chromedriver::start();
    let b = driver.browser(1280).await;

    b.sign_in(&base, WATCHER).await;
    assert_eq!(b.path().await, "/ui/leases");
    assert!(!b.exists("nav a[href='/ui/request']").await);
    b.goto(&base, "/ui/request").await;
    assert!(!b.exists("#request-form").await);
    assert!(
        b.text("p.error").await.contains("watcher is a viewer"),
        "{}",
        b.text("main").await
    );
    // A viewer reads its team.
    b.goto(&base, "/ui/team").await;
    assert!(b.text("#quota").await.contains("0 of 4 GPUs"));
    b.sign_out().await;

    // eve, of cv, sees cv and not ml.
    b.sign_in(&base, EVE).await;
    b.goto(&base, "/ui/team").await;
    assert!(b.text("h1").await.contains("Team cv"));
    b.goto(&base, "/ui/team?team=ml").await;
    assert!(
        b.text("p.error").await.contains("eve may not read team ml"),
        "{}",
        b.text("main").await
    );
    assert!(!b.exists("#quota").await);
    // Nor may she ask for ml: the form offers only her teams, and the policy refuses a forged
    // one with its reason.
    b.goto(&base, "/ui/request").await;
    let teams: Vec<String> = {
        let mut out = Vec::new();
        for option in b
            .client
            .find_all(Locator::Css("#team option"))
            .await
            .unwrap()
        {
            out.push(option.attr("value").await.unwrap().unwrap_or_default());
        }
        out
    };
    assert_eq!(teams, ["cv"]);
    // Admin pages are for admins.
    b.goto(&base, "/ui/admin").await;
    assert!(b.text("p.error").await.contains("Only admins"));
    b.goto(&base, "/ui/scorecard").await;
    assert!(b.text("p.error").await.contains("Only admins"));
    b.sign_out().await;

    // The admin sees every team.
    b.sign_in(&base, ROOT).await;
    b.goto(&base, "/ui/admin").await;
    assert!(b.exists("#teams tr[data-team='ml']").await);
    assert!(b.exists("#teams tr[data-team='cv']").await);
    b.client.close().await.unwrap();
}

/// The scores of the scorecard page, by capability.
async fn page_scores(b: &Browser) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for row in b
        .client
        .find_all(Locator::Css("#scorecard tbody tr"))
        .await
        .unwrap()
    {
        let capability = row.attr("data-capability").await.unwrap().unwrap();
        let score = row
            .find(Locator::Css(".value"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        out.push((capability, score.parse().unwrap()));
    }
    out
}

fn assess_scores(config: &Path) -> Vec<(String, u64)> {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["assess", "--config", config.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let card: Value = serde_json::from_slice(&out.stdout).unwrap();
    card["scores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["capability"].as_str().unwrap().to_string(),
                s["score"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_s_scorecard_scores_its_reclaims_as_assess_does_and_every_page_is_photographed() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path());
    let config = dir.path().join("gpuwarden.toml");
    // The banner tells a newcomer where the portal is and with which token to sign in.
    let portal_line = demo
        .banner
        .lines()
        .find(|l| l.trim_start().starts_with("Portal:"))
        .unwrap_or_else(|| panic!("no Portal line in\n{}", demo.banner));
    assert!(
        portal_line.contains(&format!("http://{}/ui/", demo.api)),
        "{portal_line}"
    );
    assert!(portal_line.contains("demo-alice-token"), "{portal_line}");
    let base = demo.api.clone();

    let driver = Chromedriver::start();
    let admin = driver.browser(1280).await;
    admin.sign_in(&base, "demo-admin-token").await;
    // The demo's idle notebooks are reclaimed within a couple of minutes: then runtime
    // enforcement scores 5, from the reclaims in the lake.
    let started = Instant::now();
    let runtime = loop {
        admin.goto(&base, "/ui/scorecard").await;
        let scores = page_scores(&admin).await;
        let row = admin
            .text("#scorecard tr[data-capability='runtime_policy_enforcement']")
            .await;
        if scores
            .iter()
            .any(|(c, s)| c == "runtime_policy_enforcement" && *s == 5)
        {
            break row;
        }
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "runtime enforcement never reached 5; it reads: {row}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    assert!(runtime.contains("idle,"), "{runtime}");
    // `gpuwarden assess` reads the same lake with the same rules: the same scores. The lake
    // grows as the demo runs, so the page is read before and after, and must agree with assess
    // whenever it did not change in between.
    let mut agreed = false;
    for _ in 0..5 {
        let before = page_scores(&admin).await;
        let assessed = assess_scores(&config);
        admin.goto(&base, "/ui/scorecard").await;
        let after = page_scores(&admin).await;
        if before == after {
            assert_eq!(assessed, before, "assess and the portal disagree");
            assert_eq!(before.len(), 8);
            agreed = true;
            break;
        }
    }
    assert!(agreed, "the scorecard changed on every read");

    // Every page, at a desktop's width and a phone's.
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("portal-shots");
    std::fs::create_dir_all(&shots).unwrap();
    eprintln!("portal screenshots: {}", shots.display());
    for width in [1280, 375] {
        let b = driver.browser(width).await;
        b.goto(&base, "/ui/signin").await;
        b.shoot(&shots, "signin").await;
        b.sign_in(&base, "demo-alice-token").await;
        b.fill("project", "llm").await;
        b.fill("gpus", "3").await;
        b.text_until("#estimate-summary", |t| t.contains("3 GPUs"))
            .await;
        b.shoot(&shots, "request").await;
        // The demo's clock runs at 60× from a day ago: every signed-in page says so.
        let clock = b.text("#clock").await;
        assert!(clock.contains("runs at 60× real time"), "{clock}");
        b.fill("gpus", "40").await;
        b.click("#ask").await;
        let summary = b.text("#estimate-summary").await;
        assert!(summary.starts_with("Denied"), "{summary}");
        // Forty fit nowhere: the price names the model it assumed.
        assert!(
            summary.contains("40 GPUs of ")
                && summary.ends_with("priced as the dearest model the request could get."),
            "{summary}"
        );
        assert!(b.text("#decision").await.starts_with("Denied"));
        assert!(b.in_first_screen("#decision").await, "{width} px");
        b.shoot(&shots, "request-denied").await;
        b.goto(&base, "/ui/leases").await;
        if width == 1280 {
            let lines = b.lines("code.id").await;
            assert!(lines.iter().all(|&n| n == 1), "{lines:?}");
            let lines = b.lines(".model").await;
            assert!(lines.iter().all(|&n| n == 1), "{lines:?}");
            assert!(
                b.fit(".table-wrap").await,
                "a leases table is wider than the page"
            );
        }
        b.shoot(&shots, "leases").await;
        b.goto(&base, "/ui/team").await;
        assert!(b.text("#spend").await.contains("spent"));
        let idle = b.text("#idle-source").await;
        assert!(idle.contains("whose data reach"), "{idle}");
        b.shoot(&shots, "team").await;
        b.sign_out().await;
        b.sign_in(&base, "demo-admin-token").await;
        b.goto(&base, "/ui/admin").await;
        assert!(b.exists("#actions tbody tr").await);
        b.shoot(&shots, "admin").await;
        b.goto(&base, "/ui/scorecard").await;
        b.shoot(&shots, "scorecard").await;
        b.client.close().await.unwrap();
    }
    admin.client.close().await.unwrap();
    let (status, log) = demo.process.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}
