//! The console's browser tests' harness: Debian's `chromium`, headless, driven through
//! `chromedriver` (WebDriver) by fantoccini. [`chromedriver`] starts the driver (or, without
//! chromium or chromedriver, fails the test when `CI` is set and records it as not run
//! otherwise); [`Ui`] opens pages, reads text and rows, waits for live updates, takes
//! screenshots and reads the browser's console (chromedriver's log and the errors the
//! console's own script collects).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};

pub const CHROMIUM: &str = "/usr/bin/chromium";

fn find(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    names.iter().find_map(|n| {
        std::env::split_paths(&path)
            .map(|d| d.join(n))
            .find(|p| p.is_file())
    })
}

/// An HTTP/1.1 request to chromedriver (which wants a Host header); the status and body.
pub fn webdriver(addr: &str, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    // chromedriver keeps the connection open: read up to the end of the body it announces.
    let mut resp = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).ok()?;
        resp.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&resp);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            });
            if n == 0 || length.is_some_and(|len| body.len() >= len) {
                break;
            }
        } else if n == 0 {
            break;
        }
    }
    crate::parse_response(&resp)
}

/// A running chromedriver, killed on drop.
pub struct Driver {
    child: Child,
    pub addr: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// chromedriver on a free port, once it answers; `None` (recorded as not run) when chromium or
/// chromedriver is missing and `CI` is unset.
pub fn chromedriver() -> Option<Driver> {
    let driver = find(&["chromedriver"]);
    let browser = Path::new(CHROMIUM).is_file();
    let (Some(driver), true) = (driver, browser) else {
        let why = "chromium or chromedriver is missing (apt-get install chromium chromium-driver; scripts/deps.sh installs them)";
        if std::env::var_os("CI").is_some() {
            panic!("CI is set and {why}: the console's browser test cannot run");
        }
        crate::docker::not_run(why);
        return None;
    };
    let port = crate::free_port();
    let child = Command::new(driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver");
    let addr = format!("127.0.0.1:{port}");
    let d = Driver { child, addr };
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if webdriver(&d.addr, "GET", "/status", "")
            .is_some_and(|(code, body)| code == 200 && body.contains("\"ready\":true"))
        {
            return Some(d);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("chromedriver did not answer on {}", d.addr);
}

pub async fn browser(driver: &Driver) -> Client {
    let caps = serde_json::json!({
        "browserName": "chrome",
        "goog:chromeOptions": {
            "binary": CHROMIUM,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--window-size=1280,800", "--disable-dev-shm-usage",
                     "--hide-scrollbars"],
        },
        "goog:loggingPrefs": {"browser": "ALL"},
    });
    let serde_json::Value::Object(caps) = caps else {
        unreachable!()
    };
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://{}", driver.addr))
        .await
        .expect("a chromium session")
}

/// The test's browser session and where things are.
pub struct Ui {
    pub c: Client,
    pub driver: String,
    pub session: String,
    pub base: String,
    pub shots: PathBuf,
}

impl Ui {
    pub async fn open(&self, path: &str) {
        self.c
            .goto(&format!("{}{path}", self.base))
            .await
            .unwrap_or_else(|e| panic!("open {path}: {e}"));
    }

    /// The browser's console messages since the last call (chromedriver's log), and the
    /// errors console.js collected on this page.
    pub async fn problems(&self) -> Vec<String> {
        let (code, body) = webdriver(
            &self.driver,
            "POST",
            &format!("/session/{}/se/log", self.session),
            r#"{"type":"browser"}"#,
        )
        .expect("chromedriver answers");
        assert_eq!(code, 200, "chromedriver's log: {body}");
        let log: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let mut out: Vec<String> = log["value"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["level"] != "INFO" && e["level"] != "DEBUG")
            .map(|e| format!("{}: {}", e["level"], e["message"]))
            .collect();
        let collected = self
            .c
            .execute(
                "return window.consoleErrors || ['console.js did not run'];",
                vec![],
            )
            .await
            .expect("script runs");
        out.extend(
            collected
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| format!("console.js: {e}")),
        );
        out
    }

    pub async fn assert_clean(&self, page: &str) {
        let problems = self.problems().await;
        assert!(
            problems.is_empty(),
            "{page}: the browser's console shows problems: {problems:#?}"
        );
    }

    pub async fn shot(&self, name: &str) {
        let png = self.c.screenshot().await.expect("screenshot");
        assert!(png.starts_with(b"\x89PNG"), "{name}: a PNG");
        std::fs::write(self.shots.join(format!("{name}.png")), png).expect("write screenshot");
    }

    pub async fn text(&self, css: &str) -> String {
        self.c
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .text()
            .await
            .expect("text")
    }

    pub async fn rows(&self, css: &str) -> Vec<String> {
        let mut out = Vec::new();
        for r in self.c.find_all(Locator::Css(css)).await.expect("rows") {
            out.push(r.text().await.expect("row text"));
        }
        out
    }

    /// Waits (up to `secs`) until `css`'s text contains `needle`; returns the text.
    pub async fn wait_text(&self, css: &str, needle: &str, secs: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let text = match self.c.find(Locator::Css(css)).await {
                Ok(e) => e.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if text.contains(needle) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "{css} never showed {needle:?}; it shows:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn path(&self) -> String {
        let url = self.c.current_url().await.expect("url");
        match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_string(),
        }
    }
}

/// Where a test's screenshots go: `$CONSOLE_SCREENSHOT_DIR` (relative to the workspace: the
/// docs' pictures are `docs/console`), else `console-screenshots` in the target directory.
pub fn screenshot_dir() -> PathBuf {
    let dir = match std::env::var_os("CONSOLE_SCREENSHOT_DIR") {
        Some(d) => crate::workspace_root().join(d),
        None => {
            let exe = std::env::current_exe().expect("test path");
            exe.parent()
                .and_then(Path::parent)
                .expect("target/<profile>")
                .join("console-screenshots")
        }
    };
    std::fs::create_dir_all(&dir).expect("screenshot directory");
    dir
}

impl Ui {
    /// A browser session on `driver`, at 1280×800, for the admin endpoint at `admin`.
    pub async fn start(driver: &Driver, admin: &str) -> Ui {
        let c = browser(driver).await;
        let session = c
            .session_id()
            .await
            .expect("session")
            .expect("a session id");
        c.set_window_size(1280, 800).await.expect("window size");
        Ui {
            c,
            driver: driver.addr.clone(),
            session,
            base: format!("http://{admin}"),
            shots: screenshot_dir(),
        }
    }
}
