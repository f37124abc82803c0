//! The benchmark report (BENCHMARKS.md): a whole report written by a full
//! run, or one section replaced in place, every section stamped with the
//! run that measured it (date, commit, machine), so a figure never claims a
//! run it did not come from.

use std::path::Path;
use std::process::Command;

const TITLE: &str = "# Benchmarks\n\n\
    Ratios matter, absolute numbers vary with machine load; each section names the run that measured it.\n";

/// The line a measured section carries under its heading.
const STAMP: &str = "_Measured ";

/// When, at which commit and on which machine this process measures.
#[derive(Debug, Clone)]
pub struct Run {
    line: String,
}

impl Run {
    /// This process's run: the UTC date, the checkout's commit (marked
    /// when the tree has changes), the CPU model, cores and memory.
    pub fn here() -> Self {
        let output = |program: &str, args: &[&str]| {
            Command::new(program)
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        let date =
            output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_else(|| "date unknown".into());
        let commit = match output("git", &["rev-parse", "--short=10", "HEAD"]) {
            // The reports themselves change as sections are written.
            Some(commit) => match output(
                "git",
                &[
                    "status",
                    "--porcelain",
                    "--untracked-files=no",
                    "--",
                    ".",
                    ":(exclude)*.md",
                ],
            ) {
                Some(changes) if !changes.is_empty() => {
                    format!("{commit} with uncommitted changes")
                }
                _ => commit,
            },
            None => "an unknown commit".into(),
        };
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split(':').nth(1))
                .map(|value| value.trim().to_string())
        };
        let cpu = field("model name").unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let cpu = match vector_extensions(&field("flags").unwrap_or_default()) {
            Some(extensions) => format!("{cpu} ({extensions})"),
            None => cpu,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| {
                let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
                let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
                Some(format!(", {:.1} GiB of memory", kib / (1024.0 * 1024.0)))
            })
            .unwrap_or_default();
        Run {
            line: format!("{STAMP}{date} at commit {commit} on {cpu}, {cores} cores{memory}._"),
        }
    }

    /// A run described by `when` alone, for tests of the reports.
    pub fn fixed(when: &str) -> Self {
        Run {
            line: format!("{STAMP}{when}._"),
        }
    }

    /// `text` with this run's line under its first line (the title).
    pub fn stamp_title(&self, text: &str) -> String {
        match text.split_once('\n') {
            Some((title, rest)) => format!("{title}\n\n{}\n{rest}", self.line),
            None => format!("{text}\n\n{}\n", self.line),
        }
    }

    /// `text` without any run's line (and the blank line after each).
    pub fn strip_stamps(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut lines = text.split_inclusive('\n').peekable();
        while let Some(line) = lines.next() {
            if line.starts_with(STAMP) {
                if lines.peek().is_some_and(|l| l.trim().is_empty()) {
                    lines.next();
                }
                continue;
            }
            out.push_str(line);
        }
        out
    }

    /// Every `## ` section of `report` with this run's line under its heading.
    pub fn stamp(&self, report: &str) -> String {
        let mut out = String::with_capacity(report.len() + 256);
        let mut lines = report.lines().peekable();
        while let Some(line) = lines.next() {
            out.push_str(line);
            out.push('\n');
            if line.starts_with("## ") {
                out.push('\n');
                out.push_str(&self.line);
                out.push('\n');
                // An old stamp (a section measured again) is replaced.
                while lines
                    .peek()
                    .is_some_and(|l| l.is_empty() || l.starts_with(STAMP))
                {
                    lines.next();
                }
                out.push('\n');
            }
        }
        out
    }
}

/// Writes a full run's `report` (its sections) and `notes` as the whole file.
pub fn write_report(path: &Path, run: &Run, report: &str, notes: &str) -> anyhow::Result<()> {
    std::fs::write(path, format!("{TITLE}\n{}\n{notes}\n", run.stamp(report)))?;
    Ok(())
}

/// Replaces (or appends) the section headed `heading` in the report at
/// `path` with `section`, stamped with `run`.
pub fn write_section(path: &Path, run: &Run, heading: &str, section: &str) -> anyhow::Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_else(|_| TITLE.into());
    let section = run.stamp(section);
    let new = match old.find(heading) {
        Some(start) => {
            let rest = &old[start + heading.len()..];
            let end = rest
                .find("\n## ")
                .or_else(|| rest.find("\nNotes:"))
                .map_or(old.len(), |i| start + heading.len() + i + 1);
            format!("{}{section}\n{}", &old[..start], &old[end..])
        }
        // New sections go before the closing notes.
        None => match old.find("\nNotes:") {
            Some(notes) => format!("{}\n{section}\n{}", &old[..notes + 1], &old[notes + 1..]),
            None => format!("{}\n\n{section}", old.trim_end()),
        },
    };
    std::fs::write(path, new)?;
    Ok(())
}

/// The vector extensions that decide the kernels' (and llama.cpp's) speed,
/// out of a `/proc/cpuinfo` flags line: here two machines of one model
/// name differed in AMX, and llama.cpp decoded the default model ~8x
/// faster on the one that had it.
fn vector_extensions(flags: &str) -> Option<String> {
    const NAMED: [(&str, &str); 4] = [
        ("avx2", "AVX2"),
        ("avx512f", "AVX-512"),
        ("avx512_vnni", "AVX-512 VNNI"),
        ("amx_tile", "AMX"),
    ];
    let present: Vec<&str> = flags.split_whitespace().collect();
    let named: Vec<&str> = NAMED
        .iter()
        .filter(|(flag, _)| present.contains(flag))
        .map(|(_, name)| *name)
        .collect();
    match named.as_slice() {
        [] => None,
        _ => Some(named.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_names_its_vector_extensions() {
        assert_eq!(
            vector_extensions("fpu avx avx2 fma avx512f avx512_vnni").as_deref(),
            Some("AVX2, AVX-512, AVX-512 VNNI")
        );
        assert_eq!(
            vector_extensions("avx2 amx_bf16 amx_tile avx512f").as_deref(),
            Some("AVX2, AVX-512, AMX")
        );
        assert_eq!(vector_extensions("fpu sse2 neon"), None);
    }

    #[test]
    fn a_section_measured_again_carries_one_stamp() {
        let run = Run {
            line: format!("{STAMP}today._"),
        };
        let once = run.stamp("## A\n\nfigures\n");
        assert_eq!(once, "## A\n\n_Measured today._\n\nfigures\n");
        let later = Run {
            line: format!("{STAMP}tomorrow._"),
        };
        assert_eq!(
            later.stamp(&once),
            "## A\n\n_Measured tomorrow._\n\nfigures\n"
        );
    }
}
