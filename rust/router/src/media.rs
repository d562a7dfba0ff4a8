//! Medium names ("GPU", "CPU", vLLM's unset medium, a tier's own name), interned to small ids
//! so that a holder (engine x medium x group) packs into one word.

use crate::error::RouterError;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The most distinct names an index interns (a stream that invents names cannot grow it
/// without bound).
pub const MAX_MEDIA: usize = 256;

#[derive(Default)]
struct Ids {
    unset: Option<u16>,
    named: HashMap<Box<str>, u16>,
}

impl Ids {
    fn get(&self, name: Option<&str>) -> Option<u16> {
        match name {
            None => self.unset,
            Some(n) => self.named.get(n).copied(),
        }
    }

    fn len(&self) -> usize {
        self.named.len() + usize::from(self.unset.is_some())
    }
}

pub(crate) struct Media {
    /// id -> name, set once when the id is handed out; read lock-free by lookups.
    names: Box<[OnceLock<Option<Box<str>>>]>,
    /// name -> id (the unset medium apart); taken by writers once per batch and medium.
    ids: Mutex<Ids>,
}

impl Media {
    pub fn new() -> Self {
        Self {
            names: (0..MAX_MEDIA).map(|_| OnceLock::new()).collect(),
            ids: Mutex::new(Ids::default()),
        }
    }

    pub fn intern(&self, name: Option<&str>) -> Result<u16, RouterError> {
        let mut ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(id) = ids.get(name) {
            return Ok(id);
        }
        let id = ids.len();
        if id >= MAX_MEDIA {
            return Err(RouterError::TooManyMedia(MAX_MEDIA));
        }
        // Under `ids`' lock: no other writer hands out this id.
        let _ = self.names[id].set(name.map(Box::from));
        match name {
            None => ids.unset = Some(id as u16),
            Some(n) => {
                ids.named.insert(n.into(), id as u16);
            }
        }
        Ok(id as u16)
    }

    /// The id of a name already interned.
    pub fn find(&self, name: Option<&str>) -> Option<u16> {
        let ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        ids.get(name)
    }

    /// The name of an id handed out (`None` inside: vLLM's unset medium).
    pub fn name(&self, id: u16) -> Option<Option<&str>> {
        self.names
            .get(usize::from(id))
            .and_then(|n| n.get())
            .map(|n| n.as_deref())
    }
}
