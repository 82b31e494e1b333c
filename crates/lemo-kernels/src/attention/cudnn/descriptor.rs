//! cuDNN backend descriptors: created, given their attributes, finalized and destroyed through one
//! owning type, with cuDNN's own explanation attached to every failure.

use std::ffi::{CStr, c_char, c_void};

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attribute, cudnnBackendAttributeType_t as AttributeType,
    cudnnBackendDescriptorType_t as Kind, cudnnStatus_t,
};

/// A failed cuDNN call: what was being done, the status, and cuDNN's last error message.
pub(crate) fn check(status: cudnnStatus_t, what: &str) -> Result<(), String> {
    if status == cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut message = [0 as c_char; 1024];
    // SAFETY: the buffer is writable for its whole length; cuDNN writes a NUL-terminated string.
    let detail = unsafe {
        sys::cudnnGetLastErrorString(message.as_mut_ptr(), message.len());
        CStr::from_ptr(message.as_ptr())
            .to_string_lossy()
            .into_owned()
    };
    Err(format!("cuDNN {what}: {status:?} {detail}"))
}

/// One backend descriptor, destroyed on drop.
pub(crate) struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
    kind: Kind,
}

// SAFETY: a descriptor is plain host state; cuDNN allows using it from any thread as long as
// calls on it do not overlap, which `&mut self` (and the owners' locks) guarantee.
unsafe impl Send for Descriptor {}

impl Descriptor {
    pub fn new(kind: Kind) -> Result<Self, String> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` receives a fresh descriptor.
        check(
            unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) },
            &format!("create {kind:?}"),
        )?;
        Ok(Self { raw, kind })
    }

    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.raw
    }

    /// Sets `attribute` to `values`, each of cuDNN type `kind` (`T` must be its C type).
    fn set<T>(
        &mut self,
        attribute: Attribute,
        kind: AttributeType,
        values: &[T],
    ) -> Result<&mut Self, String> {
        // SAFETY: `values` is a live slice of `values.len()` elements of the C type of `kind`.
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.raw,
                attribute,
                kind,
                values.len() as i64,
                values.as_ptr().cast::<c_void>(),
            )
        };
        check(status, &format!("set {attribute:?} of {:?}", self.kind))?;
        Ok(self)
    }

    pub fn int64s(&mut self, attribute: Attribute, values: &[i64]) -> Result<&mut Self, String> {
        self.set(attribute, AttributeType::CUDNN_TYPE_INT64, values)
    }

    pub fn int64(&mut self, attribute: Attribute, value: i64) -> Result<&mut Self, String> {
        self.int64s(attribute, &[value])
    }

    pub fn float(&mut self, attribute: Attribute, value: f32) -> Result<&mut Self, String> {
        self.set(attribute, AttributeType::CUDNN_TYPE_FLOAT, &[value])
    }

    pub fn boolean(&mut self, attribute: Attribute, value: bool) -> Result<&mut Self, String> {
        self.set(attribute, AttributeType::CUDNN_TYPE_BOOLEAN, &[value])
    }

    pub fn data_type(
        &mut self,
        attribute: Attribute,
        value: sys::cudnnDataType_t,
    ) -> Result<&mut Self, String> {
        self.set(attribute, AttributeType::CUDNN_TYPE_DATA_TYPE, &[value])
    }

    pub fn pointwise_mode(
        &mut self,
        value: sys::cudnnPointwiseMode_t,
    ) -> Result<&mut Self, String> {
        self.set(
            Attribute::CUDNN_ATTR_POINTWISE_MODE,
            AttributeType::CUDNN_TYPE_POINTWISE_MODE,
            &[value],
        )
    }

    pub fn reduction_operator(
        &mut self,
        value: sys::cudnnReduceTensorOp_t,
    ) -> Result<&mut Self, String> {
        self.set(
            Attribute::CUDNN_ATTR_REDUCTION_OPERATOR,
            AttributeType::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[value],
        )
    }

    pub fn heuristic_mode(
        &mut self,
        value: sys::cudnnBackendHeurMode_t,
    ) -> Result<&mut Self, String> {
        self.set(
            Attribute::CUDNN_ATTR_ENGINEHEUR_MODE,
            AttributeType::CUDNN_TYPE_HEUR_MODE,
            &[value],
        )
    }

    pub fn handle(
        &mut self,
        attribute: Attribute,
        handle: sys::cudnnHandle_t,
    ) -> Result<&mut Self, String> {
        self.set(attribute, AttributeType::CUDNN_TYPE_HANDLE, &[handle])
    }

    pub fn pointers(
        &mut self,
        attribute: Attribute,
        values: &[*mut c_void],
    ) -> Result<&mut Self, String> {
        self.set(attribute, AttributeType::CUDNN_TYPE_VOID_PTR, values)
    }

    pub fn descriptors(
        &mut self,
        attribute: Attribute,
        values: &[&Descriptor],
    ) -> Result<&mut Self, String> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = values.iter().map(|d| d.raw).collect();
        self.set(
            attribute,
            AttributeType::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            &raw,
        )
    }

    pub fn descriptor(
        &mut self,
        attribute: Attribute,
        value: &Descriptor,
    ) -> Result<&mut Self, String> {
        self.descriptors(attribute, &[value])
    }

    pub fn finalize(&mut self) -> Result<(), String> {
        // SAFETY: a live descriptor.
        check(
            unsafe { sys::cudnnBackendFinalize(self.raw) },
            &format!("finalize {:?}", self.kind),
        )
    }

    /// The first element of an int64 attribute.
    pub fn get_int64(&self, attribute: Attribute) -> Result<i64, String> {
        let mut value = 0i64;
        let mut count = 0i64;
        // SAFETY: room for one int64.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.raw,
                attribute,
                AttributeType::CUDNN_TYPE_INT64,
                1,
                &mut count,
                (&mut value as *mut i64).cast::<c_void>(),
            )
        };
        check(status, &format!("get {attribute:?} of {:?}", self.kind))?;
        Ok(value)
    }

    /// Up to `capacity` descriptors of kind `kind` held by `attribute` (cuDNN fills descriptors
    /// created by the caller).
    pub fn get_descriptors(
        &self,
        attribute: Attribute,
        kind: Kind,
        capacity: usize,
    ) -> Result<Vec<Descriptor>, String> {
        let slots = (0..capacity)
            .map(|_| Descriptor::new(kind))
            .collect::<Result<Vec<_>, _>>()?;
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = slots.iter().map(|d| d.raw).collect();
        let mut count = 0i64;
        // SAFETY: `raw` holds `capacity` live descriptors of the requested kind.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.raw,
                attribute,
                AttributeType::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                capacity as i64,
                &mut count,
                raw.as_mut_ptr().cast::<c_void>(),
            )
        };
        check(status, &format!("get {attribute:?} of {:?}", self.kind))?;
        let mut slots = slots;
        slots.truncate(count.clamp(0, capacity as i64) as usize);
        Ok(slots)
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by `cudnnBackendCreateDescriptor` and destroyed once.
        unsafe {
            sys::cudnnBackendDestroyDescriptor(self.raw);
        }
    }
}
