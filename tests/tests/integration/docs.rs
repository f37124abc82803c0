//! The documents against the binaries, so that drift fails the tests: every
//! flag README.md names is one a Corolla command accepts, and
//! `deploy/server.env.example` lists exactly the server's environment
//! variables.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use corolla_tests::{corolla_bin, corolla_server_bin};

/// Flags README.md names that belong to other tools, with where from.
const OTHER_TOOLS: &[&str] = &[
    // cargo
    "--bin",
    "--features",
    "--locked",
    "--release",
    "--test",
    // docker compose / docker build
    "--build",
    "--target",
    // systemctl
    "--now",
    // scripts/cuda.sh
    "--env",
    // certbot
    "--standalone",
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the repository")
        .to_path_buf()
}

fn help(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{} {args:?} --help failed",
        bin.display()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `--long-flag` words in `text`; a word ending in `-` (as in `--relay-*`)
/// is kept as written, a prefix.
fn long_flags(text: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let preceded_by_word =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'-');
        let mut end = start + 2;
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'-')
        {
            end += 1;
        }
        if !preceded_by_word && end > start + 2 && bytes[start + 2].is_ascii_lowercase() {
            flags.insert(text[start..end].to_string());
        }
        i = end.max(start + 2);
    }
    flags
}

/// Every long flag of `corolla` (each subcommand) and `corolla-server`.
fn accepted_flags() -> BTreeSet<String> {
    let corolla = corolla_bin();
    let top = help(&corolla, &[]);
    let subcommands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect();
    assert!(subcommands.len() >= 5, "no subcommands in: {top}");
    let mut flags = long_flags(&help(&corolla_server_bin(), &[]));
    for sub in &subcommands {
        flags.extend(long_flags(&help(&corolla, &[sub])));
    }
    flags
}

#[test]
fn every_flag_the_readme_names_exists() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let accepted = accepted_flags();
    let missing: Vec<String> = long_flags(&readme)
        .into_iter()
        .filter(|flag| !OTHER_TOOLS.contains(&flag.as_str()))
        .filter(|flag| {
            if flag.ends_with('-') {
                !accepted.iter().any(|a| a.starts_with(flag.as_str()))
            } else {
                !accepted.contains(flag)
            }
        })
        .collect();
    assert!(
        missing.is_empty(),
        "README.md names flags no Corolla command accepts: {missing:?}"
    );
}

/// `COROLLA_*` names in `text`.
fn env_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("COROLLA_") {
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..len].to_string());
        rest = &tail[len..];
    }
    names
}

#[test]
fn the_env_example_lists_every_server_variable() {
    let example = std::fs::read_to_string(repo_root().join("deploy/server.env.example"))
        .expect("deploy/server.env.example");
    let server_help = help(&corolla_server_bin(), &[]);
    let accepted: BTreeSet<String> = server_help
        .split("[env: ")
        .skip(1)
        .filter_map(|s| s.split(['=', ']']).next())
        .map(str::to_string)
        .collect();
    assert!(accepted.len() > 30, "few env names in: {server_help}");
    let listed = env_names(&example);
    let unknown: Vec<_> = listed.difference(&accepted).collect();
    let unlisted: Vec<_> = accepted.difference(&listed).collect();
    assert!(
        unknown.is_empty() && unlisted.is_empty(),
        "server.env.example names variables the server does not read: {unknown:?}; \
         it misses: {unlisted:?}"
    );
}

#[test]
fn flags_are_read_out_of_help_text() {
    let flags = long_flags("use --max-new-tokens 8, --relay-* (not x--y or --Z); --a1");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    assert_eq!(flags, ["--a1", "--max-new-tokens", "--relay-"]);
}
