//! Kernel ELF files and kernel sets: round trip, determinism, every malformed case, missing kernels.

use std::path::{Path, PathBuf};

use xdna::kernels::elf::{self, build_kernel_elf, read_kernel, wrap_elf, KernelDesc};
use xdna::kernels::set::parse_shape_list;
use xdna::kernels::{
    family_needs, ElfReason, KernelError, KernelKey, KernelNeed, KernelSet, RowFamily,
};
use xdna::tiles::{ScaleType, TileOrder, WeightFormat};

use RowFamily::{M128, M16};

const Q41H: WeightFormat = WeightFormat::Q41 {
    scale: ScaleType::F16,
    order: TileOrder::ColumnMajor,
};

/// A fresh directory under the target dir (no tempfile dependency).
fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn sample() -> KernelDesc {
    KernelDesc::gemm(Q41H, M16, 576, 960)
}

#[test]
fn round_trip_and_name() {
    let dir = scratch_dir("elf_round_trip");
    let desc = sample();
    assert_eq!(desc.file_name(), "gemm_q41h_m16_k576_n960.elf");
    let path = elf::write_kernel(&dir, &desc).expect("write");
    assert_eq!(path, dir.join("gemm_q41h_m16_k576_n960.elf"));
    let back = read_kernel(&path).expect("read");
    assert_eq!(back, desc);
    assert!(!back.has_control_code);
    assert_eq!(back.partition_columns, elf::DEFAULT_PARTITION_COLUMNS);
}

#[test]
fn output_is_deterministic() {
    let a = build_kernel_elf(&sample());
    let b = build_kernel_elf(&sample());
    assert_eq!(a, b);
    let other = build_kernel_elf(&KernelDesc::gemm(Q41H, M128, 576, 960));
    assert_ne!(a, other);
    assert_eq!(&a[..4], b"\x7fELF");
    assert_eq!(a[7], elf::OSABI_AIE2P);
}

/// Write `bytes` as a kernel file and read it back, expecting `reason`; the error names the file.
fn expect_rejected(dir: &Path, file: &str, bytes: &[u8], reason: ElfReason) {
    let path = dir.join(file);
    std::fs::write(&path, bytes).expect("write");
    match read_kernel(&path) {
        Err(err @ KernelError::Elf { .. }) => {
            let KernelError::Elf {
                path: named,
                reason: got,
            } = &err
            else {
                unreachable!()
            };
            assert_eq!(named, &path);
            assert_eq!(got, &reason, "{file}");
            assert!(err.to_string().contains(file), "{err}");
        }
        other => panic!("{file}: expected {reason:?}, got {other:?}"),
    }
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Offset of section header `index`.
fn shdr(bytes: &[u8], index: usize) -> usize {
    let shoff = u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes")) as usize;
    shoff + index * 64
}

#[test]
fn malformed_files_give_named_reasons() {
    let dir = scratch_dir("elf_malformed");
    let good = build_kernel_elf(&sample());

    let mut bad = good.clone();
    bad[0] = b'X';
    expect_rejected(&dir, "bad_magic.elf", &bad, ElfReason::BadMagic);

    let mut bad = good.clone();
    bad[4] = 1; // ELFCLASS32
    expect_rejected(&dir, "bad_class.elf", &bad, ElfReason::BadClass(1));

    let mut bad = good.clone();
    bad[7] = 0; // System V
    expect_rejected(&dir, "wrong_osabi.elf", &bad, ElfReason::WrongOsAbi(0));

    // Truncated: the section header table is at the end, so cutting the file loses it.
    let cut = &good[..good.len() - 10];
    let path = dir.join("truncated.elf");
    std::fs::write(&path, cut).expect("write");
    assert!(matches!(
        read_kernel(&path),
        Err(KernelError::Elf {
            reason: ElfReason::Truncated(_),
            ..
        })
    ));
    expect_rejected(
        &dir,
        "tiny.elf",
        &good[..20],
        ElfReason::Truncated("ELF header needs 64 bytes, file has 20".into()),
    );

    // A section whose contents run past the end of the file (section 2 = the descriptor).
    let mut bad = good.clone();
    let at = shdr(&bad, 2);
    put_u64(&mut bad, at + 32, 1 << 20);
    expect_rejected(
        &dir,
        "section_out_of_bounds.elf",
        &bad,
        ElfReason::SectionOutOfBounds(".note.xdna.kernel".into()),
    );

    // Overlap: point the descriptor at the configuration note's bytes.
    let mut bad = good.clone();
    let config_offset = u64::from_le_bytes(
        bad[shdr(&bad, 1) + 24..shdr(&bad, 1) + 32]
            .try_into()
            .expect("8"),
    );
    let at = shdr(&bad, 2);
    put_u64(&mut bad, at + 24, config_offset);
    expect_rejected(
        &dir,
        "overlap.elf",
        &bad,
        ElfReason::OverlappingSections(
            ".note.xrt.configuration".into(),
            ".note.xdna.kernel".into(),
        ),
    );

    // Unknown descriptor version: the first word of the note's payload (after the 12-byte note
    // header and the 8-byte padded name "XDNA\0").
    let mut bad = good.clone();
    let desc_offset = u64::from_le_bytes(
        bad[shdr(&bad, 2) + 24..shdr(&bad, 2) + 32]
            .try_into()
            .expect("8"),
    ) as usize;
    bad[desc_offset + 20..desc_offset + 24].copy_from_slice(&7u32.to_le_bytes());
    expect_rejected(
        &dir,
        "version.elf",
        &bad,
        ElfReason::UnknownDescriptorVersion(7),
    );

    // No descriptor at all (a toolchain ELF that was never wrapped).
    expect_rejected(
        &dir,
        "unwrapped.elf",
        &elf::synthetic_toolchain_elf(4),
        ElfReason::MissingDescriptor,
    );
}

#[test]
fn wrap_keeps_the_toolchain_sections_and_sets_the_flag() {
    let dir = scratch_dir("elf_wrap");
    let toolchain = elf::synthetic_toolchain_elf(8);
    let desc = sample();
    let wrapped = wrap_elf(&toolchain, &desc).expect("wrap");
    // The original bytes are a prefix: offsets inside it stay valid.
    assert_eq!(&wrapped[64..toolchain.len()], &toolchain[64..]);
    let parsed = elf::parse_elf(&wrapped).expect("parse");
    for name in [
        ".ctrltext",
        ".ctrldata",
        ".pdi.0",
        ".note.xrt.configuration",
    ] {
        let before = elf::parse_elf(&toolchain).expect("parse");
        let (a, b) = (
            before.section(name).expect(name),
            parsed.section(name).expect(name),
        );
        assert_eq!(
            &toolchain[a.offset..a.offset + a.size],
            &wrapped[b.offset..b.offset + b.size]
        );
    }
    let path = dir.join(desc.file_name());
    std::fs::write(&path, &wrapped).expect("write");
    let back = read_kernel(&path).expect("read");
    assert!(back.has_control_code);
    assert_eq!(back.partition_columns, 8);
    assert_eq!((back.op.as_str(), back.k, back.n), ("gemm", 576, 960));
    assert_eq!(wrap_elf(&wrapped, &desc), Err(ElfReason::AlreadyWrapped));
    assert!(matches!(
        wrap_elf(&build_kernel_elf(&desc), &desc),
        Err(ElfReason::AlreadyWrapped)
    ));
    assert_eq!(wrap_elf(&toolchain, &desc), wrap_elf(&toolchain, &desc));
}

/// Found by the `kernel_elf` fuzz target: a toolchain ELF whose configuration note is too short
/// to state a partition size was wrapped into a file the reader then refused. Both refuse it now.
#[test]
fn wrap_refuses_what_the_reader_refuses() {
    let input = include_bytes!("../fuzz/corpus/kernel_elf/short_configuration_note.elf");
    let desc = KernelDesc::gemm(Q41H, M16, 576, 960);
    let why = ElfReason::BadDescriptor("configuration note shorter than 4 bytes".into());
    assert_eq!(wrap_elf(input, &desc), Err(why));
    // Also found by it: a section name table of type NOBITS, whose names the reader took from
    // the file while the wrapper copied no bytes of it, so an old section took the new name.
    let input = include_bytes!("../fuzz/corpus/kernel_elf/name_table_of_type_nobits.elf");
    assert!(matches!(
        elf::parse_elf(input),
        Err(ElfReason::BadSectionNameTable(_))
    ));
    assert!(matches!(
        wrap_elf(input, &desc),
        Err(ElfReason::BadSectionNameTable(_))
    ));
    // And: a name table at index 0 (SHN_UNDEF, the null section, read as empty), whose names
    // the wrapper dropped, so the input's configuration note took the descriptor's name.
    let input = include_bytes!("../fuzz/corpus/kernel_elf/name_table_at_index_zero.elf");
    assert!(matches!(
        elf::parse_elf(input),
        Err(ElfReason::BadSectionNameTable(_))
    ));
    assert!(matches!(
        wrap_elf(input, &desc),
        Err(ElfReason::BadSectionNameTable(_))
    ));
}

#[test]
fn family_selection() {
    assert_eq!(RowFamily::for_rows(1), M16);
    assert_eq!(RowFamily::for_rows(16), M16);
    assert_eq!(RowFamily::for_rows(17), M128);
    assert_eq!(RowFamily::for_rows(128), M128);
    assert_eq!(RowFamily::for_rows(129), M128); // run as chunks of 128
    let passes = |rows| RowFamily::passes(rows).collect::<Vec<_>>();
    assert_eq!(passes(0), vec![]);
    assert_eq!(passes(16), vec![(M16, 0..16)]);
    assert_eq!(passes(17), vec![(M128, 0..17)]);
    assert_eq!(passes(129), vec![(M128, 0..128), (M128, 128..129)]);
    assert_eq!(
        passes(300),
        vec![(M128, 0..128), (M128, 128..256), (M128, 256..300)]
    );
    // The numbers file formats store, and the names file names carry.
    assert_eq!((M16.rows_u32(), M128.rows_u32()), (16, 128));
    assert_eq!((M16.name(), M128.name()), ("m16", "m128"));
    assert_eq!(RowFamily::from_rows(128), Some(M128));
    assert_eq!(RowFamily::from_rows(32), None);
}

/// SmolLM2-135M's kernel needs, from its description.
fn smollm_needs(body: WeightFormat, head: WeightFormat) -> Vec<KernelNeed> {
    let config = serde_json::json!({
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
        "tie_word_embeddings": true
    });
    let description =
        xdna::weights::ModelConfig::from_json(&config, "config.json").expect("config");
    family_needs(&description.kernel_shapes(body, head))
}

#[test]
fn missing_kernels_are_all_listed() {
    let dir = scratch_dir("set_missing");
    let q8h = WeightFormat::Q8 {
        scale: ScaleType::F16,
        order: TileOrder::ColumnMajor,
    };
    let needs = smollm_needs(Q41H, q8h);
    // Provide only the m16 QKV kernel.
    elf::write_kernel(&dir, &KernelDesc::gemm(Q41H, M16, 576, 960)).expect("write");
    let set = KernelSet::load(&dir).expect("load");
    assert_eq!(set.len(), 1);
    assert!(set.get(&KernelKey::gemm(Q41H, M16, 576, 960)).is_some());
    let err = set.require(&needs).expect_err("missing");
    let KernelError::Missing(lines) = &err else {
        panic!("expected Missing, got {err:?}");
    };
    // 2 families × (qkv, o, gate+up, down, lm_head) − the one present = 9 files.
    assert_eq!(lines.len(), 9, "{err}");
    let text = err.to_string();
    for file in [
        "gemm_q41h_m16_k576_n576.elf",
        "gemm_q41h_m16_k576_n3072.elf",
        "gemm_q41h_m16_k1536_n576.elf",
        "gemm_q8h_m16_k576_n49152.elf",
        "gemm_q41h_m128_k576_n960.elf",
        "gemm_q8h_m128_k576_n49152.elf",
    ] {
        assert!(
            text.contains(&dir.join(file).display().to_string()),
            "{file}: {text}"
        );
    }
    assert!(!text.contains("gemm_q41h_m16_k576_n960.elf"));
    assert!(
        text.contains("(blk.0 o, rows ≤ 16; blk.1 o, rows ≤ 16; blk.2 o, rows ≤ 16; and 27 more)"),
        "{text}"
    );
    assert!(
        text.contains("lm_head (tied token_embd), rows ≤ 128"),
        "{text}"
    );

    // After building everything, nothing is missing.
    for key in xdna::kernels::set::distinct_keys(&needs) {
        elf::write_kernel(&dir, &key.descriptor()).expect("write");
    }
    KernelSet::load(&dir)
        .expect("load")
        .require(&needs)
        .expect("complete");
}

#[test]
fn a_misnamed_or_broken_file_fails_the_load_naming_it() {
    let dir = scratch_dir("set_misnamed");
    let path = dir.join("gemm_q41h_m16_k576_n961.elf");
    std::fs::write(&path, build_kernel_elf(&sample())).expect("write");
    let err = KernelSet::load(&dir).expect_err("misnamed");
    assert!(
        err.to_string().contains("gemm_q41h_m16_k576_n961.elf"),
        "{err}"
    );
    std::fs::remove_file(&path).expect("rm");
    std::fs::write(dir.join("junk.elf"), b"not an elf").expect("write");
    let err = KernelSet::load(&dir).expect_err("junk");
    assert!(
        matches!(&err, KernelError::Elf { reason: ElfReason::BadMagic, path } if path.ends_with("junk.elf"))
    );
}

#[test]
fn shape_lists_parse_and_reject_bad_lines() {
    let path = Path::new("shapes.txt");
    let keys = parse_shape_list(
        path,
        "# comment\n\ngemm q41h 16 576 960\ngemm q8h m128 576 49152 # lm_head\n",
    )
    .expect("parse");
    assert_eq!(
        keys,
        vec![
            KernelKey::gemm(Q41H, M16, 576, 960),
            KernelKey {
                op: "gemm".into(),
                wfmt: "q8h",
                family: M128,
                k: 576,
                n: 49152,
            }
        ]
    );
    for (text, line) in [
        ("gemm q41h 16 576", 1),
        ("gemm q5 16 576 960", 1),
        ("\ngemm q41h 32 576 960", 2),
        ("gemm q41h 16 576 100", 1),
        ("gemm q41h 16 0 960", 1),
    ] {
        match parse_shape_list(path, text) {
            Err(KernelError::ShapeList { line: got, .. }) => assert_eq!(got, line, "{text}"),
            other => panic!("{text:?}: {other:?}"),
        }
    }
    let need = KernelNeed {
        key: KernelKey::gemm(Q41H, M16, 576, 960),
        what: "blk.0 qkv, rows ≤ 16".into(),
    };
    assert_eq!(need.key.file_name(), "gemm_q41h_m16_k576_n960.elf");
}
