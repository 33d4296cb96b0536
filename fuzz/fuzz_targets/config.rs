//! The config file as `gpuwarden check-config` and every component read it: `config::parse`
//! (TOML syntax, `${ENV}` substitution, keys and types, the rules across sections), then what a
//! component derives from an accepted config at start: the simulated fleet's GPUs
//! (`fleet::simulated_inventory`, which `collect --source simulated` and the enforcer's
//! `simulated` driver build), and each team's and workload's policy. A refusal must print as
//! `check-config` prints it, every error placed at a line and column that exist.
#![no_main]

use gpuwarden_schema::config;
use gpuwarden_schema::fleet::simulated_inventory;
use gpuwarden_schema::Workload;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    // `config::load` reads the file with `read_to_string`, which refuses what is not UTF-8.
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    match config::parse("fuzz.toml", text) {
        Ok(config) => {
            for substrate in &config.substrates {
                let gpus = simulated_inventory(substrate);
                let named: u64 = substrate
                    .hosts
                    .iter()
                    .map(|h| u64::from(h.count) * u64::from(h.gpus))
                    .sum();
                if substrate.driver == config::DriverKind::Simulated {
                    assert_eq!(gpus.len() as u64, named, "{substrate:?}");
                }
            }
            for team in &config.teams {
                assert!(config.team(&team.name).is_some(), "{}", team.name);
            }
            for workload in [
                Workload::Training,
                Workload::Inference,
                Workload::Notebook,
                Workload::Batch,
            ] {
                let _ = config.workload(workload);
            }
        }
        Err(errors) => {
            assert!(!errors.errors.is_empty(), "a refusal without an error");
            let lines = text.split('\n').count();
            for e in &errors.errors {
                assert!(!e.message.trim().is_empty(), "an empty message: {e:?}");
                if let Some(line) = e.line {
                    assert!((1..=lines).contains(&line), "line {line} of {lines}: {e:?}");
                }
                if let Some(column) = e.column {
                    assert!(column >= 1, "column {column}: {e:?}");
                }
            }
            // What check-config prints: must not panic, and names the file.
            let printed = errors.to_string();
            assert!(printed.starts_with("fuzz.toml: "), "{printed}");
        }
    }
});
