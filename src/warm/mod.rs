//! Ways to have bytes in the kernel's page cache before the job asks for them: the
//! archive streamed into it ([`preload`]), files pushed into the mount's own
//! ([`push`]), the tree listed ahead so the kernel knows every name ([`prelist`]).
//! Serve the FUSE side; import the archive interface, never fuser.

pub mod prelist;
pub mod preload;
pub mod push;
