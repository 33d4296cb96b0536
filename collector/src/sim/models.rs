//! What each GPU model reports: memory as NVML counts it, power limit, idle draw, clocks,
//! temperatures, and whether it has GPM (Hopper and later). Matched by case-insensitive
//! substring of the NVML model name, so `NVIDIA H100 80GB HBM3` and `NVIDIA H100 PCIe` both
//! simulate as an H100; a model the table does not know simulates with middle-of-the-road
//! figures rather than failing, because a fleet config may name any GPU.

const MIB: u64 = 1 << 20;

/// The static figures of one GPU model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ModelSpec {
    /// Framebuffer total, bytes, as `nvmlDeviceGetMemoryInfo` reports it.
    pub(crate) mem_total_bytes: u64,
    /// Enforced power limit, watts.
    pub(crate) power_limit_w: f64,
    /// Draw with no context and no work, watts.
    pub(crate) idle_power_w: f64,
    /// SM clock with no work (lowest P-state), MHz.
    pub(crate) idle_mhz: u32,
    /// SM clock with a context but little work, MHz.
    pub(crate) base_mhz: u32,
    /// SM clock under load, MHz.
    pub(crate) boost_mhz: u32,
    /// Temperature with no work, Celsius.
    pub(crate) idle_temp_c: f64,
    /// How much warmer it runs at 100 % utilization, Celsius.
    pub(crate) load_temp_rise_c: f64,
    /// Whether NVML's GPU performance metrics (SM activity and the rest) work on it: Hopper
    /// and later.
    pub(crate) gpm: bool,
}

const H100_80GB: ModelSpec = ModelSpec {
    mem_total_bytes: 81_559 * MIB,
    power_limit_w: 700.0,
    idle_power_w: 70.0,
    idle_mhz: 345,
    base_mhz: 1_590,
    boost_mhz: 1_980,
    idle_temp_c: 30.0,
    load_temp_rise_c: 42.0,
    gpm: true,
};

/// The H200 is an H100 with 141 GB of HBM3e.
const H200_141GB: ModelSpec = ModelSpec {
    mem_total_bytes: 143_771 * MIB,
    idle_power_w: 75.0,
    ..H100_80GB
};

const A100_80GB: ModelSpec = ModelSpec {
    mem_total_bytes: 81_920 * MIB,
    power_limit_w: 400.0,
    idle_power_w: 55.0,
    idle_mhz: 210,
    base_mhz: 1_095,
    boost_mhz: 1_410,
    idle_temp_c: 30.0,
    load_temp_rise_c: 38.0,
    gpm: false,
};

const A100_40GB: ModelSpec = ModelSpec {
    mem_total_bytes: 40_960 * MIB,
    power_limit_w: 400.0,
    idle_power_w: 50.0,
    ..A100_80GB
};

const L40S: ModelSpec = ModelSpec {
    mem_total_bytes: 46_068 * MIB,
    power_limit_w: 350.0,
    idle_power_w: 35.0,
    idle_mhz: 210,
    base_mhz: 1_110,
    boost_mhz: 2_520,
    idle_temp_c: 32.0,
    load_temp_rise_c: 40.0,
    gpm: false,
};

const T4: ModelSpec = ModelSpec {
    mem_total_bytes: 15_360 * MIB,
    power_limit_w: 70.0,
    idle_power_w: 10.0,
    idle_mhz: 300,
    base_mhz: 585,
    boost_mhz: 1_590,
    // Passively cooled: runs warmer at idle and under load.
    idle_temp_c: 36.0,
    load_temp_rise_c: 40.0,
    gpm: false,
};

/// For a model the table does not know: an 80 GiB, 400 W data-centre card.
const DEFAULT: ModelSpec = ModelSpec {
    mem_total_bytes: 80 * 1024 * MIB,
    ..A100_80GB
};

/// The figures for an NVML model name. An A100 that names neither size is taken to be the
/// original 40 GB part.
pub(crate) fn spec_for(model: &str) -> ModelSpec {
    let m = model.to_ascii_uppercase();
    if m.contains("H100") {
        H100_80GB
    } else if m.contains("H200") {
        H200_141GB
    } else if m.contains("A100") {
        if m.contains("80GB") {
            A100_80GB
        } else {
            A100_40GB
        }
    } else if m.contains("L40S") {
        L40S
    } else if m.contains("T4") {
        T4
    } else {
        DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_match_by_case_insensitive_substring() {
        let h100 = spec_for("NVIDIA H100 80GB HBM3");
        assert_eq!(h100.mem_total_bytes, 85_520_809_984);
        assert_eq!(h100.power_limit_w, 700.0);
        assert_eq!(spec_for("nvidia h100 pcie"), h100);
        assert_eq!(
            spec_for("NVIDIA A100-SXM4-80GB").mem_total_bytes,
            85_899_345_920
        );
        assert_eq!(
            spec_for("NVIDIA A100-SXM4-40GB").mem_total_bytes,
            42_949_672_960
        );
        assert_eq!(spec_for("NVIDIA L40S").power_limit_w, 350.0);
        assert_eq!(spec_for("NVIDIA L40S").mem_total_bytes, 46_068 * MIB);
        assert_eq!(spec_for("Tesla T4").power_limit_w, 70.0);
        assert_eq!(spec_for("Tesla T4").mem_total_bytes, 15_360 * MIB);
        let h200 = spec_for("NVIDIA H200");
        assert_eq!(h200.mem_total_bytes, 143_771 * MIB);
        assert_eq!(h200.power_limit_w, 700.0);
    }

    #[test]
    fn hopper_models_have_gpm() {
        for (model, gpm) in [
            ("NVIDIA H100 80GB HBM3", true),
            ("NVIDIA H200", true),
            ("NVIDIA A100-SXM4-80GB", false),
            ("NVIDIA L40S", false),
            ("Tesla T4", false),
            ("Some Future GPU", false),
        ] {
            assert_eq!(spec_for(model).gpm, gpm, "{model}");
        }
    }

    #[test]
    fn unknown_models_get_defaults() {
        let spec = spec_for("Some Future GPU");
        assert_eq!(spec.mem_total_bytes, 80 << 30);
        assert_eq!(spec.power_limit_w, 400.0);
        assert!(spec.idle_power_w > 0.0 && spec.idle_power_w < spec.power_limit_w);
        assert!(spec.idle_mhz < spec.base_mhz && spec.base_mhz < spec.boost_mhz);
    }
}
