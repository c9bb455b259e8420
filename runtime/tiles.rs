//! Placeholder: weight tile formats.
