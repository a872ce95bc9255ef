//! The syscall seam of the Linux driver: every `iptables-*` and `ipset` invocation goes through
//! a [`CommandRunner`], so unit tests can swap the kernel for `fake::FakeKernel` (built for
//! tests and with the `test-util` feature only).

use std::io::Write as _;
use std::process::{Command, Stdio};

/// What a command printed and whether it succeeded.
#[derive(Clone, Debug, Default)]
pub struct Output {
    pub success: bool,
    /// Exit code, when the process exited normally.
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    /// The first lines of stderr, for error messages.
    pub fn stderr_summary(&self) -> String {
        let text = String::from_utf8_lossy(&self.stderr);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(5)
            .collect();
        if lines.is_empty() {
            format!("exit code {:?}", self.code)
        } else {
            lines.join("; ")
        }
    }
}

/// Runs external programs.
pub trait CommandRunner: Send {
    /// Runs `program args…`, feeding `stdin` if given. `Err` only when the program could not be
    /// run at all (not installed, not executable); a failing exit is an `Ok` with `success`
    /// false.
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::io::Result<Output>;
}

/// Runs real processes.
#[derive(Debug, Default)]
pub struct SystemRunner;

impl CommandRunner for SystemRunner {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::io::Result<Output> {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        if let Some(input) = stdin {
            // Write from a thread: a large input could otherwise deadlock against a full stdout.
            let mut pipe = child.stdin.take().expect("stdin is piped");
            let input = input.to_vec();
            let writer = std::thread::spawn(move || pipe.write_all(&input));
            let out = child.wait_with_output()?;
            // A program that exits early closes its stdin; its exit status says why.
            let _ = writer.join();
            return Ok(Output {
                success: out.status.success(),
                code: out.status.code(),
                stdout: out.stdout,
                stderr: out.stderr,
            });
        }
        let out = child.wait_with_output()?;
        Ok(Output {
            success: out.status.success(),
            code: out.status.code(),
            stdout: out.stdout,
            stderr: out.stderr,
        })
    }
}
