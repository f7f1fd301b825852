//! `psnet-doctor DIR`: reads the flight recorder dumps a job left in DIR and says which rank
//! or node is at fault, then the evidence per node. `psnet-doctor --timeline DIR -o FILE`
//! writes the dumps as one Chrome trace instead.

use std::path::PathBuf;
use std::process::ExitCode;

use psnet_recorder::{doctor, timeline};

const USAGE: &str = "usage: psnet-doctor DIR\n       psnet-doctor --timeline DIR -o FILE\n\
DIR: where the job's nodes wrote their flight recorder dumps (PSNET_RECORDER_DIR; by default \
psnet-recorder in the system's temporary directory).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (timeline_mode, dir, out) = match args.as_slice() {
        [dir] if dir != "-h" && dir != "--help" => (false, PathBuf::from(dir), None),
        [flag, dir, o, out] if flag == "--timeline" && o == "-o" => {
            (true, PathBuf::from(dir), Some(PathBuf::from(out)))
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let (dumps, skipped) = match doctor::read_dir(&dir) {
        Ok(read) => read,
        Err(e) => {
            eprintln!("psnet-doctor: cannot read {}: {e}", dir.display());
            return ExitCode::from(2);
        }
    };
    for s in &skipped {
        eprintln!("psnet-doctor: skipped {s}");
    }
    if timeline_mode {
        let out = out.expect("parsed with -o");
        let trace = timeline::chrome_trace(&dumps);
        let text = match serde_json::to_string(&trace) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("psnet-doctor: {e}");
                return ExitCode::from(1);
            }
        };
        if let Err(e) = std::fs::write(&out, text) {
            eprintln!("psnet-doctor: cannot write {}: {e}", out.display());
            return ExitCode::from(1);
        }
        println!(
            "wrote {} ({} dumps): open it in chrome://tracing or ui.perfetto.dev",
            out.display(),
            dumps.len()
        );
        return ExitCode::SUCCESS;
    }
    print!("{}", doctor::report(&dumps));
    ExitCode::SUCCESS
}
