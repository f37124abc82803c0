//! Names of LoRA adapters: what a server announces, a client asks for in
//! its Open and the OpenAI API takes after the model's name
//! (`model:adapter`), so a name has no `:` and no spaces.

/// The longest adapter name (a hub repository id is at most 96 characters).
pub const MAX_ADAPTER_NAME_LEN: usize = 128;

/// The most adapters one server offers (each is announced in its record).
pub const MAX_ADAPTERS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid adapter name {name:?}: use 1 to {MAX_ADAPTER_NAME_LEN} letters, digits and . _ - / (such as a hub id, user/name)")]
pub struct AdapterNameError {
    pub name: String,
}

/// `name` if it is a valid adapter name.
pub fn check_adapter_name(name: &str) -> Result<&str, AdapterNameError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_ADAPTER_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    match valid {
        true => Ok(name),
        false => Err(AdapterNameError {
            name: name.chars().take(MAX_ADAPTER_NAME_LEN + 1).collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_pass_and_separators_do_not() {
        assert!(check_adapter_name("tloen/alpaca-lora-7b").is_ok());
        assert!(check_adapter_name("sql_v1.2").is_ok());
        for bad in ["", "a:b", "a b", "ä", &"x".repeat(MAX_ADAPTER_NAME_LEN + 1)] {
            assert!(check_adapter_name(bad).is_err(), "{bad:?}");
        }
    }
}
