/* The parts of <corosync/cmap.h> that cpgbroker uses, as cffi cdef text: read a few keys of
 * the running corosync's configuration (is the ring encrypted, on which addresses; how long
 * the others take to declare a member lost).
 * Values are "..." so the compiler takes them from the installed headers.
 */

typedef uint64_t cmap_handle_t;

#define CS_OK ...
#define CS_ERR_NOT_EXIST ...
#define CMB_BINDING_VERSION ...

int cmap_initialize(cmap_handle_t *handle);
int cmap_finalize(cmap_handle_t handle);
/* On CS_OK *value is a malloc'ed, NUL-terminated string the caller frees (cmb_free). */
int cmap_get_string(cmap_handle_t handle, const char *key_name, char **value);
void cmb_free(void *p);
int cmap_get_uint32(cmap_handle_t handle, const char *key_name, uint32_t *u32);
