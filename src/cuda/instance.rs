//! The name of a kernel instance: a kernel of `kernels/` with its template
//! arguments, as NVRTC takes it (a name expression) and the caches key it.

use super::type_name;
use crate::ffi::{DataType, Error, Result};
use std::fmt::Display;

/// Builds `kernel<arg, arg, ...>` from typed arguments, in the kernel's
/// template parameter order: element types (`typename`), integers (`int`)
/// and flags (`bool`). A kernel without template parameters is its name.
pub struct Instance {
    name: String,
    arguments: Vec<String>,
    /// The first argument the kernels cannot take.
    error: Option<Error>,
}

impl Instance {
    pub fn new(kernel: &str) -> Self {
        Self { name: kernel.to_owned(), arguments: Vec::new(), error: None }
    }

    /// A `typename` argument: the kernels' type for `dtype`.
    pub fn dtype(mut self, dtype: DataType) -> Self {
        match type_name(dtype) {
            Ok(name) => self.arguments.push(name.to_owned()),
            Err(error) => self.fail(error),
        }
        self
    }

    /// An `int` argument.
    pub fn int<V: TryInto<i32> + Display + Copy>(mut self, value: V) -> Self {
        match value.try_into() {
            Ok(int) => self.arguments.push(int.to_string()),
            Err(_) => self.fail(Error::invalid_argument(format!("{value}: past a kernel's int template argument"))),
        }
        self
    }

    /// A `bool` argument.
    pub fn flag(mut self, value: bool) -> Self {
        self.arguments.push(value.to_string());
        self
    }

    /// The instance's name, or the first argument's error.
    pub fn build(self) -> Result<String> {
        if let Some(error) = self.error {
            return Err(error);
        }
        Ok(if self.arguments.is_empty() { self.name } else { format!("{}<{}>", self.name, self.arguments.join(", ")) })
    }

    fn fail(&mut self, error: Error) {
        self.error.get_or_insert(error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_follow_the_name_in_order() {
        let instance = Instance::new("topk_fwd").dtype(DataType::BF16).int(256usize).int(8u32).flag(true).build();
        assert_eq!(instance.unwrap(), "topk_fwd<bf16, 256, 8, true>");
        assert_eq!(Instance::new("group_bounds").build().unwrap(), "group_bounds");
    }

    #[test]
    fn an_argument_the_kernels_cannot_take_is_an_error() {
        let error = Instance::new("k").dtype(DataType::S64).int(1usize).build().unwrap_err();
        assert!(error.message().contains("no CUDA kernel for dtype"), "{}", error.message());
        let error = Instance::new("k").int(1usize << 40).build().unwrap_err();
        assert!(error.message().contains("int template argument"), "{}", error.message());
    }
}
