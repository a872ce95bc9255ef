//! IP-set member strings, interned.
//!
//! Contract: an address (or `addr,proto:port`) that is a member of several IP sets is stored
//! once; each set keeps only the member's id and its reference count there. An id stays valid
//! while at least one set holds it ([`Members::hold`] / [`Members::release`] count the sets),
//! and is reused after that.

use std::sync::Arc;

use rustc_hash::FxHashMap;

pub(super) type MemberId = u32;

#[derive(Default)]
pub(super) struct Members {
    strings: Vec<Arc<str>>,
    ids: FxHashMap<Arc<str>, MemberId>,
    /// Per id, how many sets hold it.
    sets: Vec<u32>,
    free: Vec<MemberId>,
}

impl Members {
    /// The id of `member`, allocating one (held by no set yet) if it has none.
    pub(super) fn id(&mut self, member: &Arc<str>) -> MemberId {
        if let Some(&id) = self.ids.get(member) {
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.strings[id as usize] = member.clone();
                id
            }
            None => {
                self.strings.push(member.clone());
                self.sets.push(0);
                MemberId::try_from(self.strings.len() - 1).expect("fewer than 2^32 members")
            }
        };
        self.ids.insert(member.clone(), id);
        id
    }

    /// The id of `member` if some set holds it.
    pub(super) fn existing(&self, member: &str) -> Option<MemberId> {
        self.ids.get(member).copied()
    }

    pub(super) fn get(&self, id: MemberId) -> &Arc<str> {
        &self.strings[id as usize]
    }

    /// One more set holds `id`.
    pub(super) fn hold(&mut self, id: MemberId) {
        self.sets[id as usize] += 1;
    }

    /// One fewer set holds `id`; the last one frees it.
    pub(super) fn release(&mut self, id: MemberId) {
        let n = &mut self.sets[id as usize];
        *n -= 1;
        if *n == 0 {
            let s = std::mem::replace(&mut self.strings[id as usize], Arc::from(""));
            self.ids.remove(&s);
            self.free.push(id);
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_lives_while_a_set_holds_it() {
        let mut m = Members::default();
        let a: Arc<str> = Arc::from("10.0.0.1/32");
        let id = m.id(&a);
        m.hold(id);
        m.hold(id);
        assert_eq!(m.id(&a), id, "one id per string");
        m.release(id);
        assert_eq!(m.existing("10.0.0.1/32"), Some(id));
        m.release(id);
        assert_eq!(m.existing("10.0.0.1/32"), None, "freed with its last set");
        let b = m.id(&Arc::from("10.0.0.2/32"));
        assert_eq!(b, id, "the id is reused");
        assert_eq!(&**m.get(b), "10.0.0.2/32");
        assert_eq!(m.len(), 1);
    }
}
