//! Writes the seed corpus, `fuzz/corpus/<target>/<name>`, from psnet's own encoders:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example gen_corpus
//! ```
//!
//! Files of other names in those directories (regression inputs) are left alone.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for seed in psnet_fuzz::seeds::all() {
        let dir = root.join(seed.target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(&seed.name), &seed.bytes)?;
    }
    println!("wrote {}", root.display());
    Ok(())
}
